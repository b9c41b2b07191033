"""Bad input that the fuzzed reader (test_inputs.py) does not reach: lines too large to read whole,
a file with no newline at all, a last line cut mid-record."""

from __future__ import annotations

import gzip
import json
import zlib
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_common.store import Store
from precompute import inputs
from precompute.cli import main
from precompute.inputs import (
    MAX_RECORD_BYTES,
    SkipLog,
    iter_raw_records,
    parse_or_skip,
    resolve_inputs,
)
from precompute.tokenizing import UnitTokenizer

from precompute_helpers import chat, cli_args, make_config

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _read(path):
    skips = SkipLog(10)
    out = [
        (raw.source_id, parse_or_skip(raw, "auto", skips))
        for raw in iter_raw_records(resolve_inputs([path]), skips)
    ]
    return out, skips


def test_huge_lines_are_skipped_unread_and_counted_and_line_numbers_stay_right(tmp_path):
    path = tmp_path / "huge.jsonl"
    good = json.dumps(CHAT).encode()
    with open(path, "wb") as f:
        f.write(good + b"\n")
        huge = b'{"messages": "' + b"x" * (MAX_RECORD_BYTES + 10) + b'"}\n'  # valid JSON, too large
        f.write(huge)
        f.write(good + b"\n")
        f.write(b"y" * (2 * MAX_RECORD_BYTES) + b"\n")
        f.write(good + b"\n")
        f.write(b"z" * (MAX_RECORD_BYTES + 3))  # the file ends inside it: no newline
    out, skips = _read(str(path))
    assert [sid.rsplit(":", 1)[1] for sid, _ in out] == ["1", "2", "3", "4", "5", "6"]
    assert [p is not None for _, p in out] == [True, False, True, False, True, False]
    assert dict(skips.counts) == {"record_too_large": 3}
    assert skips.examples[0] == (
        "huge.jsonl:2",
        "record_too_large",  # the file by its name, not its path
        f"a line of {len(huge):,} bytes (more than {MAX_RECORD_BYTES:,})",
    )


def test_a_line_exactly_at_the_limit_is_read(tmp_path):
    path = tmp_path / "edge.jsonl"
    record = json.dumps({"messages": CHAT["messages"], "pad": ""}).encode()
    record = (
        record[:-2] + b" " * (MAX_RECORD_BYTES - len(record)) + record[-2:]
    )  # spaces inside the JSON
    assert len(record) == MAX_RECORD_BYTES
    path.write_bytes(record + b"\n" + record)
    out, skips = _read(str(path))
    assert [p is not None for _, p in out] == [True, True] and skips.total == 0


# ------------------------------------------------------------------------------------------------
# Fuzzed files through the reader and the tokenizer: each line is built to be good or bad in one
# known way, so its fate (kept, truncated, or skipped with this reason) is checked line by line.
# Every file holds every kind at least once, in a random order, with random content and noise.

MAX_LENGTH = 256  # tokens; the over-long kind is longer, every other kind far shorter
SMALL_RECORD_LIMIT = 4096  # bytes: MAX_RECORD_BYTES for the fuzz, so huge lines stay cheap
_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12)
_ids = st.lists(st.integers(0, 255), min_size=10, max_size=30)


def _answer(text: str) -> str:
    return f"answer: {text}."  # >= 9 bytes: >= 10 response tokens with <|im_end|>, over 2 x block 4


def _chat(user: str, answer: str) -> dict:
    return {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    }


def _dumps(obj) -> bytes:
    return json.dumps(obj).encode()  # ASCII: a cut never falls inside a character


@st.composite
def _fuzz_line(draw, kind: str, plain: bool, drop: bool) -> tuple[bytes, str]:
    """A line of `kind` -> (line, fate): 'kept',
    'truncated', a skip reason, or 'any' (random noise)."""
    u, a = draw(_text), _answer(draw(_text))
    good = _dumps(_chat(u, a))
    if kind == "good":
        return good, "kept"
    if kind == "sharegpt":
        return _dumps(
            {"conversations": [{"from": "human", "value": u}, {"from": "gpt", "value": a}]}
        ), "kept"
    if kind == "tokenized":
        ids = draw(_ids)
        start = draw(st.integers(0, len(ids) - 8))  # >= 8 response tokens
        return _dumps(
            {"input_ids": ids, "loss_mask": [0] * start + [1] * (len(ids) - start)}
        ), "kept"
    if kind == "too_long":
        return _dumps(
            _chat(u, "x" * (MAX_LENGTH + draw(st.integers(1, 100))))
        ), "too_long" if drop else "truncated"
    if kind == "assistant_first":  # the rendering path cannot find the first turn's prompt
        line = _dumps({"messages": [{"role": "assistant", "content": a}, *_chat(u, a)["messages"]]})
        return line, "assistant_turn_first" if plain else "kept"
    if kind == "cut":
        return good[: draw(st.integers(1, len(good) - 1))], "malformed_json"
    if kind == "non_utf8":
        at = draw(st.integers(0, len(good)))
        return good[:at] + draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80"])) + good[
            at:
        ], "invalid_utf8"
    if kind == "huge":
        return b'{"messages": "' + b"x" * (
            SMALL_RECORD_LIMIT + draw(st.integers(0, 3000))
        ) + b'"}', "record_too_large"
    if kind == "noise":
        return draw(st.binary(max_size=30)).replace(b"\n", b" "), "any"
    line, reason = draw(st.sampled_from(_BAD[kind]))
    return (line if isinstance(line, bytes) else _dumps(line)), reason


_BAD = {  # fixed bad records, by kind: (line, reason)
    "blank": [(b"", "blank_line"), (b"  \t\r", "blank_line")],
    "surrogate": [(_dumps(_chat("\ud800", _answer(""))), "invalid_utf8")],
    "not_an_object": [
        (b"[1, 2]", "not_an_object"),
        (b'"text"', "not_an_object"),
        (b"null", "not_an_object"),
        (b"NaN", "not_an_object"),
    ],
    "missing_field": [
        ({"text": "hi"}, "missing_field"),
        (
            {"messages": [{"content": "q"}, {"role": "assistant", "content": _answer("")}]},
            "missing_field",
        ),
        (
            {"messages": [{"role": "user"}, {"role": "assistant", "content": _answer("")}]},
            "missing_field",
        ),
        ({"input_ids": [1, 2, 3]}, "missing_field"),
    ],
    "wrong_field_type": [
        ({"messages": "hi"}, "wrong_field_type"),
        ({"messages": {"role": "user"}}, "wrong_field_type"),
        ({"messages": ["hi", "there"]}, "wrong_field_type"),
        ({"messages": [{"role": 3, "content": "q"}]}, "wrong_field_type"),
        ({"messages": [{"role": "user", "content": 7}]}, "wrong_field_type"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "wrong_field_type"),
        ({"input_ids": ["a"], "loss_mask": [1]}, "wrong_field_type"),
        ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "wrong_field_type"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "wrong_field_type"),
    ],
    "unknown_role": [({"messages": [{"role": "robot", "content": "q"}]}, "unknown_role")],
    "empty": [
        ({"messages": []}, "empty_conversation"),
        ({"conversations": []}, "empty_conversation"),
        ({"input_ids": [], "loss_mask": []}, "empty_conversation"),
    ],
    "no_assistant": [
        ({"messages": [{"role": "user", "content": "q"}]}, "no_assistant_turn"),
        (
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
            "no_assistant_turn",
        ),
    ],
    "short_answer": [
        (_chat("q", "x" * n), "too_few_response_tokens") for n in range(7)
    ],  # n + 1 < 8 tokens
    "id_out_of_range": [
        ({"input_ids": [5] * 9 + [320], "loss_mask": [1] * 10}, "token_id_out_of_range")
    ],
}
_KINDS = [
    "good",
    "sharegpt",
    "tokenized",
    "too_long",
    "assistant_first",
    "cut",
    "non_utf8",
    "huge",
    "noise",
    *_BAD,
]
_unit_tokenizers: dict = {}


def _unit_tokenizer(target, plain: bool, drop: bool, tmp_path) -> UnitTokenizer:
    if (plain, drop) not in _unit_tokenizers:
        cfg = make_config(
            target,
            ["unused"],
            tmp_path / "s",
            f"data.max_length={MAX_LENGTH}",
            "data.report_first=1000",
            f'data.overlength="{"drop" if drop else "truncate"}"',
        )
        _unit_tokenizers[plain, drop] = UnitTokenizer.from_target(str(target), cfg.data)
    return _unit_tokenizers[plain, drop]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    plain=st.booleans(),
    drop=st.booleans(),
    gz=st.booleans(),
    final_newline=st.booleans(),
)
def test_fuzzed_files_every_line_is_kept_or_skipped_with_its_reason(
    data,
    plain,
    drop,
    gz,
    final_newline,
    tiny_target,
    tiny_target_2layer,
    tmp_path_factory,
    monkeypatch,
):
    monkeypatch.setattr(inputs, "MAX_RECORD_BYTES", SMALL_RECORD_LIMIT)
    kinds = data.draw(
        st.permutations(_KINDS + data.draw(st.lists(st.sampled_from(_KINDS), max_size=8)))
    )
    lines = [
        data.draw(_fuzz_line(kind, plain, drop)) for kind in kinds
    ]  # every kind, in a random order
    while not final_newline and lines[-1][0] == b"":
        lines.pop()  # an empty last line without its newline is no line at all
    body = b"\n".join(line for line, _ in lines) + (b"\n" if final_newline else b"")
    path = tmp_path_factory.mktemp("fuzz") / ("f.jsonl.gz" if gz else "f.jsonl")
    path.write_bytes(gzip.compress(body) if gz else body)

    reader_skips = SkipLog(1000)
    records = list(iter_raw_records(resolve_inputs([str(path)]), reader_skips))
    target = tiny_target_2layer if plain else tiny_target
    unit = _unit_tokenizer(target, plain, drop, tmp_path_factory.getbasetemp())(0, records)

    assert reader_skips.total == 0 and len(records) == len(lines)
    assert unit.num_samples + unit.skips.total == len(
        lines
    )  # every line: kept, or skipped with a reason
    fate = {sid: reason for sid, reason, _ in unit.skips.examples}
    kept = set(unit.sample_ids)
    for n, (_, expected) in enumerate(lines, start=1):
        sid = f"{path.name}:{n}"  # a sample id names the file, not its path
        if expected in ("kept", "truncated"):
            assert sid in kept, (expected, fate.get(sid), lines[n - 1])
        elif expected != "any":
            assert fate.get(sid) == expected, (expected, fate.get(sid), lines[n - 1])
    assert unit.truncated == sum(e == "truncated" for _, e in lines)
    assert sum(unit.skips.counts.values()) == len(
        fate
    )  # every skip is among the examples kept here


# ------------------------------------------------------------------------------------------------
# End to end: dflash-precompute over a file of every kind of bad record between good ones.


def _mixed_bad_input(tmp_path) -> tuple[list[str], list[str], dict[str, str], int]:
    """-> (inputs, ids of the records to keep, {id: reason} of the bad ones, records in all)."""
    good = [_dumps(chat(i)) for i in range(6)]
    bad = [  # (line, reason), each between two good lines
        (b"", "blank_line"),
        (good[0][:30] + b"\xff" + good[0][30:], "invalid_utf8"),
        (b'{"messages": [{"role": "user", "content": "q"}', "malformed_json"),
        (b"[1, 2, 3]", "not_an_object"),
        (_dumps({"prompt": "q", "response": "a"}), "missing_field"),
        (
            _dumps(
                {
                    "messages": [
                        {"role": "user", "content": 5},
                        {"role": "assistant", "content": "a" * 40},
                    ]
                }
            ),
            "wrong_field_type",
        ),
        (
            _dumps(
                {
                    "messages": [
                        {"role": "robot", "content": "q"},
                        {"role": "assistant", "content": "a" * 40},
                    ]
                }
            ),
            "unknown_role",
        ),
        (_dumps({"messages": []}), "empty_conversation"),
        (_dumps({"messages": [{"role": "user", "content": "q"}]}), "no_assistant_turn"),
        (_dumps(chat(50, answer_len=2)), "too_few_response_tokens"),
        (
            _dumps({"input_ids": [5] * 10 + [100_000], "loss_mask": [1] * 11}),
            "token_id_out_of_range",
        ),
        (b'{"messages": "' + b"x" * (MAX_RECORD_BYTES + 1) + b'"}', "record_too_large"),
    ]
    path = tmp_path / "mixed.jsonl"
    lines = [good[0]]
    for i, (line, _) in enumerate(bad):
        lines += [line, good[1 + i % 5]]
    lines.append(_dumps(chat(60, answer_len=300)))  # longer than data.max_length: truncated, kept
    cut = good[2][: len(good[2]) // 2]  # the file ends inside its last record, without a newline
    path.write_bytes(b"\n".join(lines + [cut]))
    reasons = {
        f"{path.name}:{2 + 2 * i}": reason for i, (_, reason) in enumerate(bad)
    }  # by file name
    reasons[f"{path.name}:{len(lines) + 1}"] = "malformed_json"
    keep = [
        f"{path.name}:{n}" for n in range(1, len(lines) + 1) if f"{path.name}:{n}" not in reasons
    ]

    whole = gzip.compress(b"".join(_dumps(chat(100 + i)) + b"\n" for i in range(300)))
    gz = (
        tmp_path / "cut.jsonl.gz"
    )  # a copy cut short: the lines before the cut are read, then it stops
    gz.write_bytes(whole[: len(whole) // 2])
    readable = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(gz.read_bytes()).count(b"\n")
    keep += [f"{gz.name}:{n}" for n in range(1, readable + 1)]
    return [str(path), str(gz)], keep, reasons, len(lines) + 1 + readable


def test_bad_input_end_to_end_every_skip_counted_in_the_plan_and_the_stores_summary(
    tiny_target, tmp_path, capsys
):
    paths, keep, reasons, records = _mixed_bad_input(tmp_path)
    store = tmp_path / "store"
    args = cli_args(
        tiny_target, paths, store, "bf16", "--data.max_length=128", "--data.report_first=100"
    )
    main(args)
    out = capsys.readouterr().out

    expected = Counter(reasons.values()) + Counter({"unreadable_file": 1})
    summary = Store.open(store).summary
    assert summary["skips"]["counts"] == dict(expected)
    assert (
        summary["records"] == records
        and summary["samples"] == len(keep)
        and summary["truncated"] == 1
    )
    for sid, reason in reasons.items():  # the plan names each with its file and line
        assert f"e.g. skipped {sid}: {reason} (" in out, (sid, reason)
    assert f"e.g. skipped {paths[1]}: unreadable_file (reading stopped after" in out
    assert f"skipped {sum(expected.values())} (" in out and "truncated 1" in out
    with Store.open(
        store
    ) as s:  # the store holds the good records, in input order, and nothing else
        assert [sid for name in s.shard_names() for sid in s.read_shard(name).sample_ids] == keep

    main(args + ["--out", str(tmp_path / "drop"), "--data.overlength=drop", "--dry-run"])
    assert ", too_long 1," in capsys.readouterr().out  # dropped instead of truncated, and counted


def test_an_input_whose_every_record_is_skipped_is_refused_with_the_counts_and_no_store(
    tiny_target, tmp_path, capsys
):
    path = tmp_path / "bad.jsonl"
    short = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    }
    path.write_text(
        '{"messages": [\n' + "\n" + json.dumps(short) + "\n" + json.dumps(short) + "\n[1, 2]\n"
    )
    store = tmp_path / "store"
    for extra in ([], ["--dry-run"]):
        with pytest.raises(SystemExit) as caught:
            main(cli_args(tiny_target, [str(path)], store, "bf16", *extra))
        err = capsys.readouterr().err
        assert caught.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert "every one of the 5 input records" in err
        assert "blank_line 1, malformed_json 1, not_an_object 1, too_few_response_tokens 2" in err
        assert (
            "bad.jsonl:1: malformed_json; bad.jsonl:2: blank_line; bad.jsonl:3: "
            "too_few_response_tokens" in err
        )
        assert not store.exists()  # no empty store left behind

    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit) as caught:
        main(cli_args(tiny_target, [str(tmp_path / "empty.jsonl")], store, "bf16"))
    assert (
        caught.value.code == 2
        and "hold no record" in capsys.readouterr().err
        and not store.exists()
    )
