"""Input readers: formats, stable ids, deterministic
order, streaming, and bad input counted by reason."""

from __future__ import annotations

import gzip
import json
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_common.conversations import BadRecord
from dflash_common.errors import UserError
from precompute.inputs import (
    Conversation,
    PreTokenized,
    SkipLog,
    iter_raw_records,
    parse_or_skip,
    parse_record,
    resolve_inputs,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n")
    return str(path)


def read_all(entries, fmt="auto", report_first=5):
    skips = SkipLog(report_first)
    out = []
    for raw in iter_raw_records(resolve_inputs(entries), skips):
        parsed = parse_or_skip(raw, fmt, skips)
        out.append((raw.index, raw.source_id, parsed))
    return out, skips


def test_three_jsonl_formats_and_source_ids(tmp_path):
    path = write_lines(
        tmp_path / "a.jsonl",
        [
            CHAT,
            {
                "conversations": [
                    {"from": "system", "value": "s"},
                    {"from": "human", "value": "q"},
                    {"from": "gpt", "value": "a"},
                ]
            },
            {"input_ids": [1, 2, 3], "loss_mask": [0, 1, True]},
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                    {"role": "assistant", "content": "c", "reasoning_content": "think"},
                ]
            },
        ],
    )
    out, skips = read_all([path])
    assert skips.total == 0
    # a sample id names its file by its own name, not its
    # path (shard names must not depend on where inputs lie)
    assert [sid for _, sid, _ in out] == [f"a.jsonl:{i}" for i in range(1, 5)]
    assert out[0][2] == Conversation("a.jsonl:1", CHAT["messages"])
    assert [m["role"] for m in out[1][2].messages] == ["system", "user", "assistant"]
    assert out[2][2] == PreTokenized("a.jsonl:3", [1, 2, 3], [0, 1, 1])
    assert out[3][2].messages == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c", "reasoning_content": "think"},
    ]


def test_bad_records_are_skipped_counted_and_the_first_kept(tmp_path):
    lines = [
        b"{not json",
        b"\xff\xfe{}",
        b"",
        b"[1, 2]",
        {"text": "no known key"},
        {"messages": "hi"},
        {"messages": []},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]},
        {"conversations": [{"from": "robot", "value": "x"}]},
        {"input_ids": [1, 2], "loss_mask": [1]},
        {"input_ids": [1, -2], "loss_mask": [1, 1]},
        {"input_ids": [1, 2]},
        (
            b'{"messages": [{"role": "user", "content": "\\ud800"}, '
            b'{"role": "assistant", "content": "x"}]}'
        ),
        b"[" * 100000,
        CHAT,
    ]
    path = write_lines(tmp_path / "bad.jsonl", lines)
    out, skips = read_all([path], report_first=3)
    assert [sid for _, sid, p in out if p is not None] == [f"bad.jsonl:{len(lines)}"]
    assert dict(skips.counts) == {
        "malformed_json": 2,
        "invalid_utf8": 2,
        "blank_line": 1,
        "not_an_object": 1,
        "missing_field": 3,
        "wrong_field_type": 4,
        "empty_conversation": 1,
        "no_assistant_turn": 1,
        "unknown_role": 2,
    }
    assert skips.total == len(lines) - 1
    assert [e[:2] for e in skips.examples] == [
        ("bad.jsonl:1", "malformed_json"),
        ("bad.jsonl:2", "invalid_utf8"),
        ("bad.jsonl:3", "blank_line"),
    ]


def test_forced_format_requires_its_field():
    raw = next(iter_raw_records_from_bytes([json.dumps(CHAT).encode()]))
    with pytest.raises(BadRecord) as e:
        parse_record(raw, "sharegpt")
    assert e.value.reason == "missing_field"


def iter_raw_records_from_bytes(lines):
    from precompute.inputs import RawRecord

    for i, line in enumerate(lines):
        yield RawRecord(i, f"mem:{i + 1}", line)


def test_order_is_deterministic_across_globs_and_duplicates(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.jsonl"):
        write_lines(tmp_path / name, [CHAT, CHAT])
    d = tmp_path / "dir"
    d.mkdir()
    write_lines(d / "z.jsonl", [CHAT])
    gz = tmp_path / "g.jsonl.gz"
    with gzip.open(gz, "wb") as f:
        f.write((json.dumps(CHAT) + "\n").encode())
    entries = [str(tmp_path / "c.jsonl"), str(tmp_path / "*.jsonl"), str(d), str(gz)]
    out, skips = read_all(entries)
    ids = [sid.rsplit(":", 1)[0] for _, sid, _ in out]
    names = [os.path.basename(p) for p in dict.fromkeys(ids)]
    assert names == ["c.jsonl", "a.jsonl", "b.jsonl", "z.jsonl", "g.jsonl.gz"]
    assert [i for i, _, _ in out] == list(range(len(out))) and len(out) == 8 and skips.total == 0


def test_missing_inputs_are_a_user_error(tmp_path):
    with pytest.raises(UserError, match="matches no file"):
        resolve_inputs([str(tmp_path / "nope*.jsonl")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="neither a saved dataset"):
        resolve_inputs([str(tmp_path / "empty")])


def test_truncated_gzip_is_counted_and_reading_goes_on(tmp_path):
    data = gzip.compress(b"".join((json.dumps(CHAT) + "\n").encode() for _ in range(200)))
    (tmp_path / "a.jsonl.gz").write_bytes(data[: len(data) // 2])
    write_lines(tmp_path / "b.jsonl", [CHAT])
    out, skips = read_all([str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.jsonl")])
    assert skips.counts["unreadable_file"] == 1
    assert out[-1][1] == "b.jsonl:1"


def test_saved_datasets_and_dataset_dicts(tmp_path):
    import datasets

    rows = [CHAT, {"messages": [], "conversations": None}]
    ds = datasets.Dataset.from_list([{"messages": json.dumps(r.get("messages"))} for r in rows])
    ds = ds.map(lambda r: {"messages": json.loads(r["messages"])})
    ds.save_to_disk(tmp_path / "ds")
    datasets.DatasetDict({"train": ds, "extra": ds.select([0])}).save_to_disk(tmp_path / "dd")
    out, skips = read_all([str(tmp_path / "ds"), str(tmp_path / "dd")])
    assert [sid for _, sid, _ in out] == [
        "ds:0",
        "ds:1",
        "dd[extra]:0",
        "dd[train]:0",
        "dd[train]:1",
    ]
    assert out[0][2].messages == CHAT["messages"]
    assert dict(skips.counts) == {"empty_conversation": 2}


def test_reading_streams_without_loading_the_file(tmp_path):
    """A FIFO delivers the first line while the writer still holds the rest back: a reader that
    loaded the whole file would never yield."""
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    first_seen = threading.Event()

    def writer():
        with open(fifo, "wb") as f:
            f.write((json.dumps(CHAT) + "\n").encode())
            f.flush()
            first_seen.wait(timeout=20)
            f.write((json.dumps(CHAT) + "\n").encode())

    t = threading.Thread(target=writer)
    t.start()
    it = iter_raw_records(resolve_inputs([str(fifo)]))
    assert next(it).source_id == "pipe.jsonl:1"
    first_seen.set()
    assert next(it).source_id == "pipe.jsonl:2"
    t.join(timeout=20)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "messages",
                    "conversations",
                    "input_ids",
                    "loss_mask",
                    "role",
                    "content",
                    "from",
                    "value",
                    "type",
                    "text",
                    "reasoning_content",
                    "tool_calls",
                    "x",
                ]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)
_line = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
    _json.map(lambda v: json.dumps(v).encode()),
    st.just(json.dumps(CHAT).encode()),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(lines=st.lists(_line, max_size=12))
def test_fuzz_never_crashes_and_counts_every_skip(tmp_path_factory, lines):
    path = write_lines(tmp_path_factory.mktemp("fuzz") / "f.jsonl", lines)
    out, skips = read_all([path])
    assert len(out) == len(lines)
    assert skips.total == sum(p is None for _, _, p in out)
    assert all(isinstance(p, (Conversation, PreTokenized)) for _, _, p in out if p is not None)
