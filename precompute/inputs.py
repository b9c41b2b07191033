"""Read the input conversations: JSONL files (OpenAI `messages`, ShareGPT `conversations`,
pre-tokenized `input_ids` + `loss_mask`) and `datasets` datasets saved on disk, several files or
globs in one run.

Reading is two cheap steps so that a rank can walk the whole input and parse only its own work
units: `iter_raw_records` streams records (a JSONL line as bytes, a dataset row by index) with a
global position and a stable source id (`path:line`, 1-based, or `path:index`); `parse_record` turns
one into a `Conversation` (messages read by dflash_common/conversations.py, the reader of every
stage) or a `PreTokenized` sequence, or raises `BadRecord(reason, detail)`.

Bad input never stops the run and is never silent: every skipped record is counted by reason in a
`SkipLog`, and the first few are reported with their file and line (in the plan). Reasons of this
module:

    blank_line, invalid_utf8, malformed_json, not_an_object, missing_field, wrong_field_type,
    unknown_role, empty_conversation, no_assistant_turn, unreadable_file, record_too_large

(the chat template and the length rules add theirs; see precompute/tokenizing.py).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from dflash_common.conversations import BadRecord, conversation_format, conversation_messages
from dflash_common.errors import UserError


# Markers of a directory written by `datasets` save_to_disk (a Dataset, or a DatasetDict of splits).
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
# A JSONL line longer than this is skipped unread (`record_too_large`): a file without newlines (a
# JSON array, a binary) would otherwise be read whole into memory, and rendering tens of MB through
# a chat template takes minutes, all to keep data.max_length tokens. Real records are far shorter: a
# 128K-token conversation is ~0.5 MB.
MAX_RECORD_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class Source:
    """One input: a JSONL file, or one split of a dataset saved on disk."""

    path: str
    kind: str  # "jsonl" | "dataset"
    split: str | None = None

    @property
    def name(self) -> str:
        return self.path if self.split is None else f"{self.path}[{self.split}]"

    @property
    def label(self) -> str:
        """How sample ids name this source ("train.jsonl", "ds[test]"): by the file's (or saved
        dataset's) own name, not by where it lies, as the store's dataset fingerprint names files.
        Sample ids go into the shard names, so inputs moved or mounted elsewhere (another node, a
        rerun after a copy) name the same shards, and a resume finds them."""
        base = os.path.basename(os.path.normpath(self.path))
        return base if self.split is None else f"{base}[{self.split}]"


@dataclasses.dataclass(frozen=True)
class RawRecord:
    """One input record before parsing. `index` counts
    records across all sources, in input order."""

    index: int
    source_id: str
    payload: Any  # bytes (a JSONL line), TooLarge, a _DatasetRow, or an already loaded row (dict)

    def portable(self) -> "RawRecord":
        """The same record with a dataset row loaded, so it can be sent to another process."""
        if isinstance(self.payload, _DatasetRow):
            return RawRecord(self.index, self.source_id, self.payload.load())
        return self


@dataclasses.dataclass(frozen=True)
class TooLarge:
    """Stands for a JSONL line over MAX_RECORD_BYTES, which was skipped unread."""

    nbytes: int


@dataclasses.dataclass(frozen=True)
class _DatasetRow:
    dataset: Any
    row: int

    def load(self) -> Any:
        return self.dataset[self.row]


@dataclasses.dataclass(frozen=True)
class Conversation:
    source_id: str
    messages: list[dict[str, Any]]  # role/content (+ reasoning_content, tool_calls where given)
    # the record's finish_reason is "length" (dflash-generate): its last assistant turn was cut by
    # max_new_tokens, so the end-of-turn token the template appends to it was never generated
    last_turn_cut: bool = False
    # dflash-generate's `answer_ids`: the tokens the target emitted for the last assistant turn
    answer_ids: list[int] | None = None
    tools: list[Any] | None = None  # the record's tool specs, which the template renders
    # dflash-generate's `earlier_answer_ids`: those of each earlier assistant turn (turns = "all")
    earlier_answer_ids: list[list[int]] | None = None


@dataclasses.dataclass(frozen=True)
class PreTokenized:
    source_id: str
    input_ids: list[int]
    loss_mask: list[int]


class SkipLog:
    """Counts skipped records by reason and keeps the first `report_first` with their source id.

    Units are tokenized apart (and in parallel), so a SkipLog logs nothing itself: the plan merges
    the units' logs in input order and reports the first few of the whole input (`Plan.format`)."""

    def __init__(self, report_first: int = 5):
        self.report_first = report_first
        self.counts: Counter[str] = Counter()
        self.examples: list[tuple[str, str, str]] = []  # (source_id, reason, detail)

    def add(self, source_id: str, reason: str, detail: str) -> None:
        self.counts[reason] += 1
        if len(self.examples) < self.report_first:
            self.examples.append((source_id, reason, detail))

    def merge(self, other: "SkipLog") -> None:
        self.counts.update(other.counts)
        room = max(0, self.report_first - len(self.examples))
        self.examples.extend(other.examples[:room])

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "counts": dict(sorted(self.counts.items())),
            "examples": [list(e) for e in self.examples],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], report_first: int = 5) -> "SkipLog":
        out = cls(report_first)
        out.counts.update(data.get("counts", {}))
        out.examples = [tuple(e) for e in data.get("examples", [])][:report_first]
        return out


# ---------------------------------------------------------------------------------------- sources


def resolve_inputs(entries: list[str]) -> list[Source]:
    """Expand paths, globs and directories into sources, in a deterministic order.

    Entries keep their configured order; a glob's matches are sorted by path; a file matched twice
    is read once (where it first appears). An entry that matches nothing is a UserError."""
    sources: list[Source] = []
    seen: set[str] = set()
    for entry in entries:
        matches = sorted(glob.glob(os.path.expanduser(entry), recursive=True))
        if not matches:
            raise UserError(
                f"data.inputs entry '{entry}' matches no file; fix the path or the glob."
            )
        for path in matches:
            for source in _sources_of(path):
                if source.name not in seen:
                    seen.add(source.name)
                    sources.append(source)
    if not sources:
        raise UserError(
            "data.inputs names no input file; give JSONL files, globs or saved datasets."
        )
    return sources


def _sources_of(path: str) -> list[Source]:
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, m)) for m in _DATASET_MARKERS):
            return _dataset_sources(path)
        files = sorted(
            glob.glob(os.path.join(path, "*.jsonl")) + glob.glob(os.path.join(path, "*.jsonl.gz"))
        )
        if not files:
            raise UserError(f"directory {path} holds neither a saved dataset nor *.jsonl files.")
        return [Source(f, "jsonl") for f in files]
    if not os.access(path, os.R_OK):
        raise UserError(f"input file {path} cannot be read; check its permissions.")
    return [Source(path, "jsonl")]


def _dataset_sources(path: str) -> list[Source]:
    dict_file = Path(path) / "dataset_dict.json"
    if dict_file.is_file():  # a DatasetDict: every split, in sorted order
        splits = json.loads(dict_file.read_text()).get("splits", [])
        return [Source(path, "dataset", split) for split in sorted(splits)]
    return [Source(path, "dataset")]


# ---------------------------------------------------------------------------------------- records


def iter_raw_records(sources: list[Source], skips: SkipLog | None = None) -> Iterator[RawRecord]:
    """Stream every record of every source in order, without parsing (cheap: a rank skips records of
    units it does not own). A file that breaks mid-way (e.g. truncated gzip) is counted once as
    `unreadable_file` in `skips` and reading goes on with the next source."""
    index = 0
    for source in sources:
        it = (
            _iter_dataset(source)
            if source.kind == "dataset"
            else _iter_jsonl(source.path, source.label)
        )
        try:
            for source_id, payload in it:
                yield RawRecord(index, source_id, payload)
                index += 1
        except (OSError, EOFError, ValueError) as e:
            if skips is None:
                raise
            skips.add(source.name, "unreadable_file", f"reading stopped after {index} records: {e}")


def _iter_jsonl(path: str, label: str) -> Iterator[tuple[str, bytes | TooLarge]]:
    """(sample id "label:line", the line) of every line of the file at `path`."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        line_no = 0
        while line := f.readline(MAX_RECORD_BYTES + 1):  # never more than the cap in memory
            line_no += 1
            if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
                yield f"{label}:{line_no}", TooLarge(len(line) + _skip_line(f))
            else:
                yield f"{label}:{line_no}", line


def _skip_line(f) -> int:
    """Read past the rest of the current line, 1 MiB at a time; -> the bytes skipped."""
    skipped = 0
    while piece := f.readline(1 << 20):
        skipped += len(piece)
        if piece.endswith(b"\n"):
            break
    return skipped


def _iter_dataset(source: Source) -> Iterator[tuple[str, _DatasetRow]]:
    try:
        import datasets  # heavy import, only when a dataset is read
    except ImportError:
        raise UserError(
            f"{source.path} is a saved `datasets` dataset but the datasets package is not "
            "installed; run `pip install 'dflash[hf-datasets]'`."
        ) from None

    ds = datasets.load_from_disk(source.path)  # memory-mapped Arrow: rows are read on access
    if source.split is not None:
        ds = ds[source.split]
    for row in range(len(ds)):
        yield f"{source.label}:{row}", _DatasetRow(ds, row)


# ---------------------------------------------------------------------------------------- parsing


def parse_record(
    raw: RawRecord, fmt: str = "auto", require_assistant: bool = True
) -> Conversation | PreTokenized:
    """One raw record -> a conversation or a pre-tokenized sequence; BadRecord if it is unusable.
    `require_assistant=False` accepts conversations without an assistant turn (prompts to
    answer)."""
    obj = record_object(raw)
    fmt = _detect_format(obj) if fmt == "auto" else fmt
    cut = obj.get("finish_reason") == "length"
    if fmt in ("messages", "sharegpt"):
        messages = conversation_messages(obj, fmt, require_assistant)
        ids, earlier = obj.get("answer_ids"), obj.get("earlier_answer_ids")
        if ids is not None and not _token_ids(ids):
            raise BadRecord(
                "wrong_field_type", "'answer_ids' must be a list of non-negative integers"
            )
        if earlier is not None and not (
            isinstance(earlier, list) and all(_token_ids(e) for e in earlier)
        ):
            raise BadRecord(
                "wrong_field_type",
                "'earlier_answer_ids' must be a list of lists of non-negative integers",
            )
        tools = obj.get("tools") if isinstance(obj.get("tools"), list) else None
        return Conversation(
            raw.source_id, messages, cut, ids or None, tools or None, earlier or None
        )
    return _pre_tokenized(raw.source_id, obj)


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


def record_object(raw: RawRecord) -> dict:
    """The JSON object of a raw record (a JSONL line or a dataset row); BadRecord if it is none."""
    payload = raw.payload
    if isinstance(payload, TooLarge):
        raise BadRecord(
            "record_too_large",
            f"a line of {payload.nbytes:,} bytes (more than {MAX_RECORD_BYTES:,})",
        )
    obj = (
        _load_json_line(payload)
        if isinstance(payload, bytes)
        else (payload.load() if isinstance(payload, _DatasetRow) else payload)
    )
    if not isinstance(obj, dict):
        raise BadRecord(
            "not_an_object", f"a record must be a JSON object, got {type(obj).__name__}"
        )
    return obj


def _load_json_line(line: bytes) -> Any:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord("invalid_utf8", f"byte {e.start} is not UTF-8") from None
    if not text.strip():
        raise BadRecord("blank_line", "empty line")
    try:
        return json.loads(text)
    except RecursionError:
        raise BadRecord("malformed_json", "nested too deeply") from None
    except ValueError as e:  # JSONDecodeError
        raise BadRecord("malformed_json", str(e)) from None


def _detect_format(obj: dict) -> str:
    fmt = conversation_format(obj) or ("tokenized" if "input_ids" in obj else None)
    if fmt is not None:
        return fmt
    raise BadRecord("missing_field", "record has none of 'messages', 'conversations', 'input_ids'")


def _field(obj: dict, key: str) -> Any:
    if key not in obj:
        raise BadRecord("missing_field", f"record has no '{key}'")
    return obj[key]


def _pre_tokenized(source_id: str, obj: dict) -> PreTokenized:
    ids, mask = _field(obj, "input_ids"), _field(obj, "loss_mask")
    if not _token_ids(ids):
        raise BadRecord("wrong_field_type", "'input_ids' must be a list of non-negative integers")
    if not (isinstance(mask, list) and all(type(m) in (int, bool) and m in (0, 1) for m in mask)):
        raise BadRecord("wrong_field_type", "'loss_mask' must be a list of 0/1")
    if len(ids) != len(mask):
        raise BadRecord(
            "wrong_field_type", f"'input_ids' has {len(ids)} tokens, 'loss_mask' {len(mask)}"
        )
    if not ids:
        raise BadRecord("empty_conversation", "'input_ids' is empty")
    return PreTokenized(source_id, ids, [int(m) for m in mask])


def parse_or_skip(raw: RawRecord, fmt: str, skips: SkipLog) -> Conversation | PreTokenized | None:
    """parse_record, with a bad record counted in
    `skips` (and logged if among the first) instead."""
    try:
        return parse_record(raw, fmt)
    except BadRecord as e:
        skips.add(raw.source_id, e.reason, e.detail)
        return None
