"""Bad input that the fuzzed reader (test_inputs.py) does not reach: lines too large to read whole,
a file with no newline at all, a last line cut mid-record."""

from __future__ import annotations

import json

from precompute.inputs import MAX_RECORD_BYTES, SkipLog, iter_raw_records, parse_or_skip, resolve_inputs

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _read(path):
    skips = SkipLog(10)
    out = [(raw.source_id, parse_or_skip(raw, "auto", skips)) for raw in iter_raw_records(resolve_inputs([path]), skips)]
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
    assert skips.examples[0] == (f"{path}:2", "record_too_large",
                                 f"a line of {len(huge):,} bytes (more than {MAX_RECORD_BYTES:,})")


def test_a_line_exactly_at_the_limit_is_read(tmp_path):
    path = tmp_path / "edge.jsonl"
    record = json.dumps({"messages": CHAT["messages"], "pad": ""}).encode()
    record = record[:-2] + b" " * (MAX_RECORD_BYTES - len(record)) + record[-2:]  # spaces inside the JSON
    assert len(record) == MAX_RECORD_BYTES
    path.write_bytes(record + b"\n" + record)
    out, skips = _read(str(path))
    assert [p is not None for _, p in out] == [True, True] and skips.total == 0
