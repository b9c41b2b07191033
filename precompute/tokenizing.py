"""The tokens of each work unit: the chat template
and the length rules, once, kept in a token cache.

Applying the chat template is the slow part of reading (a Jinja render per turn). The plan needs the
token counts, so the plan pass tokenizes each rank's units (precompute/units.py) and keeps the
result in a token cache (`run.cache_dir`, default `<store.path>.tokens/<key>/unit-XXXXXXXX.npz`, 5
bytes per token); the forward pass then reads the cache instead of tokenizing again, and a restarted
run finds the units already tokenized. A `--dry-run` reads the cache where it exists but writes
nothing: units it does not find are tokenized for the plan's counts and dropped. The cache key
hashes the tokenizer files, the data options and the input files' sizes and modification times, so
changed inputs or options never reuse stale tokens. Units can be tokenized by a pool of processes
(`run.tokenize_workers`).

Skip reasons added here (see precompute/inputs.py for the reader's): the chat template's
(`template_error`, `template_rewrites_history`, `assistant_turn_first`), `token_id_out_of_range`,
`too_long` (with data.overlength = 'drop') and `too_few_response_tokens` (< 2 x data.block_size).
Truncated sequences are kept and counted as `truncated`.

A conversation dflash-generate answered carries the tokens of its last answer (`answer_ids`): its
sequence is that answer's prompt as the target was fed it, then those tokens
(dflash_common.chat `tokenize_as_generated`), counted as `as_generated`; where the ids do not spell
the stored text (edited since, or another tokenizer) the text is tokenized, counted as
`ids_unused`. Its earlier answers (`earlier_answer_ids`, turns = "all") stay in the loss where the
prompt holds them as the target emitted them; one the template renders otherwise there (a reasoning
template drops its thinking) is context only there, counted as `earlier_masked`, and with
`data.earlier_answers = "apart"` (default) a sample of its own (`<source id>#<message index>`: the
prompt it answered, then its ids), counted as `earlier_apart`.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import io
import json
import logging
import multiprocessing
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dflash_common.chat import ChatMaskError, ChatTemplate
from dflash_common.fingerprint import chat_template_sha256, tokenizer_fingerprint
from dflash_common.fsutil import atomic_write_bytes
from dflash_common.hf import load_text_config, load_tokenizer
from precompute.config import DataSection, PrecomputeConfig
from precompute.inputs import (
    Conversation,
    RawRecord,
    SkipLog,
    Source,
    iter_raw_records,
    parse_or_skip,
)
from precompute.units import iter_unit_records, num_units, owner

# Part of the token cache's key: raised whenever the tokenization rules change (which tokens, loss
# mask, sample ids), so a cache made under other rules is never read back.
TOKENIZE_VERSION = 5


# ---------------------------------------------------------------------------------- tokenized units


@dataclasses.dataclass
class TokenizedUnit:
    """The samples of one work unit that survived the rules, laid end to end."""

    index: int
    num_records: int
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    offsets: np.ndarray  # int64 [N+1]; sample n is [offsets[n], offsets[n+1])
    sample_ids: list[str]
    skips: SkipLog
    truncated: int = 0
    as_generated: int = 0  # answers from their answer_ids
    ids_unused: int = 0  # answers whose answer_ids did not spell their text: tokenized from it
    earlier_masked: int = 0  # earlier answers out of the loss: not rendered as the target emitted
    earlier_apart: int = 0  # of those, trained as sequences of their own (data.earlier_answers)

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def content_digest(self) -> str:
        """Hash of what the unit holds (ids, tokens,
        mask, boundaries), the base of its shard name."""
        h = hashlib.sha256(f"unit {self.index}\0".encode())
        h.update("\0".join(self.sample_ids).encode())
        for array in (self.offsets, self.input_ids, self.loss_mask):
            h.update(np.ascontiguousarray(array).tobytes())
        return h.hexdigest()

    def summary(self) -> "UnitSummary":
        return UnitSummary(
            self.index,
            self.num_records,
            self.num_samples,
            self.num_tokens,
            int(self.loss_mask.sum()),
            self.truncated,
            self.skips.to_dict(),
            self.content_digest(),
            self.as_generated,
            self.ids_unused,
            self.earlier_masked,
            self.earlier_apart,
        )

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        meta = {
            "index": self.index,
            "num_records": self.num_records,
            "truncated": self.truncated,
            "as_generated": self.as_generated,
            "ids_unused": self.ids_unused,
            "earlier_masked": self.earlier_masked,
            "earlier_apart": self.earlier_apart,
            "skips": self.skips.to_dict(),
            "sample_ids": self.sample_ids,
        }
        np.savez(
            buf,
            input_ids=self.input_ids,
            loss_mask=self.loss_mask,
            offsets=self.offsets,
            meta=np.array(json.dumps(meta)),
        )
        return buf.getvalue()

    @classmethod
    def from_file(cls, path: str | Path, report_first: int = 5) -> "TokenizedUnit":
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            return cls(
                meta["index"],
                meta["num_records"],
                z["input_ids"],
                z["loss_mask"],
                z["offsets"],
                meta["sample_ids"],
                SkipLog.from_dict(meta["skips"], report_first),
                meta["truncated"],
                meta["as_generated"],
                meta["ids_unused"],
                meta["earlier_masked"],
                meta["earlier_apart"],
            )


@dataclasses.dataclass(frozen=True)
class UnitSummary:
    """What the plan needs from a tokenized unit (small enough to gather from every rank)."""

    index: int
    records: int
    samples: int
    tokens: int
    response_tokens: int
    truncated: int
    skips: dict[str, Any]
    digest: str
    as_generated: int = 0
    ids_unused: int = 0
    earlier_masked: int = 0
    earlier_apart: int = 0


# ------------------------------------------------------------------------------------ tokenizing


class UnitTokenizer:
    """Records of a unit -> TokenizedUnit, applying the chat template and the length rules."""

    def __init__(self, chat: ChatTemplate, data: DataSection, vocab_size: int):
        self.chat = chat
        self.data = data
        self.vocab_size = vocab_size

    @classmethod
    def from_target(
        cls, target_path: str, data: DataSection, vocab_size: int | None = None
    ) -> "UnitTokenizer":
        """The target's tokenizer and template; `vocab_size`: its config's (read if not given)."""
        tokenizer = load_tokenizer(target_path)
        if vocab_size is None:
            vocab_size = load_text_config(target_path).vocab_size
        # Pre-tokenized ids must index the embedding, which may have more rows than the tokenizer
        # has tokens (padded vocabularies; targets that emit ids the tokenizer cannot spell).
        vocab = max(len(tokenizer), vocab_size)
        return cls(ChatTemplate(tokenizer, data.chat_template_kwargs), data, vocab)

    def __call__(self, index: int, records: list[RawRecord]) -> TokenizedUnit:
        skips, truncated = SkipLog(self.data.report_first), 0
        ids, masks, sample_ids, answers = [], [], [], Counter()
        for record in records:
            got = self._samples(record, skips)
            if got is None:
                continue
            how, masked, samples = got
            for sample_id, tokens, mask, cut in samples:
                ids.append(tokens)
                masks.append(mask)
                sample_ids.append(sample_id)
                truncated += cut
            answers[how] += 1
            answers["earlier_masked"] += masked
            answers["earlier_apart"] += sum(s[0] != record.source_id for s in samples)
        offsets = np.zeros(len(ids) + 1, np.int64)
        offsets[1:] = np.cumsum([len(t) for t in ids])

        def cat(xs: list[np.ndarray], dt: type) -> np.ndarray:
            return np.concatenate(xs).astype(dt, copy=False) if xs else np.zeros(0, dt)

        return TokenizedUnit(
            index,
            len(records),
            cat(ids, np.int32),
            cat(masks, np.uint8),
            offsets,
            sample_ids,
            skips,
            truncated,
            answers["as_generated"],
            answers["ids_unused"],
            answers["earlier_masked"],
            answers["earlier_apart"],
        )

    def _samples(self, record: RawRecord, skips: SkipLog):
        """-> (how, earlier answers masked, [(sample id, input_ids, loss_mask, was_truncated)]) or
        None (counted in skips): the record's sequence and, with data.earlier_answers = 'apart',
        one per earlier answer its sequence masks (sample id `<source id>#<message index>`), each
        under the length rules; None when none is left."""
        parsed = parse_or_skip(record, self.data.format, skips)
        if parsed is None:
            return None
        try:
            ids, mask, how, masked = self._tokens(parsed)
            sequences = [(record.source_id, ids, mask)]
            if self.data.earlier_answers == "apart" and masked:
                emitted = dict(zip(_assistant_turns(parsed.messages), parsed.earlier_answer_ids))
                for i in masked:
                    turn = self.chat.turn_as_generated(parsed.messages, i, emitted[i], parsed.tools)
                    sequences.append((f"{record.source_id}#{i}", *turn))
        except ChatMaskError as e:
            skips.add(record.source_id, e.reason, e.detail)
            return None
        samples = [s for s in (self._fit(*seq, skips) for seq in sequences) if s is not None]
        return (how, len(masked), samples) if samples else None

    def _fit(self, sample_id: str, ids: np.ndarray, mask: np.ndarray, skips: SkipLog):
        """-> (sample id, input_ids, loss_mask, was_truncated) under the length rules, or None
        (counted in skips)."""
        cut = len(ids) > self.data.max_length
        if cut and self.data.overlength == "drop":
            skips.add(
                sample_id, "too_long", f"{len(ids)} tokens > data.max_length {self.data.max_length}"
            )
            return None
        ids, mask = ids[: self.data.max_length], mask[: self.data.max_length]
        if int(mask.sum()) < 2 * self.data.block_size:
            skips.add(
                sample_id,
                "too_few_response_tokens",
                f"{int(mask.sum())} response tokens < 2 x data.block_size {self.data.block_size}",
            )
            return None
        return sample_id, ids, mask, int(cut)

    def _tokens(self, parsed) -> tuple[np.ndarray, np.ndarray, str, list[int]]:
        """-> (input_ids, loss_mask, how, the earlier answers masked: message indices): how is
        'as_generated' (the last answer's answer_ids), 'ids_unused' (answer_ids that do not spell
        the text: the text), 'text' or 'tokens'."""
        if isinstance(parsed, Conversation):
            got, how = None, "text"
            if parsed.answer_ids:
                earlier = parsed.earlier_answer_ids or []
                if max(max(ids, default=0) for ids in [parsed.answer_ids, *earlier]) < (
                    self.vocab_size
                ):  # else another tokenizer's
                    got = self.chat.tokenize_as_generated(
                        parsed.messages,
                        parsed.answer_ids,
                        not parsed.last_turn_cut,
                        parsed.tools,
                        parsed.earlier_answer_ids,
                    )
                how = "as_generated" if got is not None else "ids_unused"
            if got is None:
                got = (*self.chat.tokenize(parsed.messages, parsed.last_turn_cut, parsed.tools), [])
            ids, mask, masked = got
            return ids, mask, how, masked
        self._check_range(parsed.input_ids)
        ids = np.asarray(parsed.input_ids, np.int32)
        return ids, np.asarray(parsed.loss_mask, np.uint8), "tokens", []

    def _check_range(self, ids: list[int]) -> None:
        if max(ids) >= self.vocab_size:
            raise ChatMaskError(
                "token_id_out_of_range",
                f"token id {max(ids)} >= the target's {self.vocab_size} embeddings",
            )


def _assistant_turns(messages: list[dict[str, Any]]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


# ------------------------------------------------------------------------------------ token cache


class TokenCache:
    """Tokenized units on disk, under a directory named by everything that decides their tokens."""

    def __init__(self, root: Path, report_first: int = 5):
        self.root = root
        self.report_first = report_first

    @classmethod
    def for_config(
        cls, cfg: PrecomputeConfig, sources: list[Source], tokenizer: dict[str, Any] | None = None
    ) -> "TokenCache":
        """The cache of this config's units; `tokenizer` is `tokenizer_identity(cfg.target.path)`
        (computed here when not given)."""
        base = Path(cfg.run.cache_dir or f"{cfg.store.path.rstrip('/')}.tokens")
        key = {
            "version": TOKENIZE_VERSION,
            "tokenizer": tokenizer
            if tokenizer is not None
            else tokenizer_identity(cfg.target.path),
            "data": {
                k: v
                for k, v in dataclasses.asdict(cfg.data).items()
                if k not in ("inputs", "report_first")
            },
            "samples_per_unit": cfg.run.samples_per_unit,
            "sources": [_source_stamp(s) for s in sources],
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[
            :16
        ]
        return cls(base / digest, cfg.data.report_first)

    def path(self, unit: int) -> Path:
        return self.root / f"unit-{unit:08d}.npz"

    def has(self, unit: int) -> bool:
        return self.path(unit).is_file()

    def save(self, unit: TokenizedUnit) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path(unit.index), unit.to_bytes(), durable=False)  # re-derivable

    def load(self, unit: int) -> TokenizedUnit:
        return TokenizedUnit.from_file(self.path(unit), self.report_first)

    def remove_leftovers(self) -> int:
        """Remove what saves cut by a kill left behind (hidden temporary files, never read); -> how
        many. Call it only when no process of the job writes the cache any more."""
        leftovers = list(self.root.glob(".unit-*.tmp-*")) if self.root.is_dir() else []
        for path in leftovers:
            path.unlink(missing_ok=True)
        return len(leftovers)


def tokenizer_identity(target_path: str) -> dict[str, Any]:
    """What decides the tokens of a conversation: the tokenizer's vocabulary and special tokens and
    the chat template (the store manifest's fingerprints of them)."""
    tokenizer = load_tokenizer(target_path)
    return {
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template_sha256": chat_template_sha256(tokenizer),
    }


def _source_stamp(source: Source) -> list[Any]:
    paths = [Path(source.path)] if source.kind == "jsonl" else sorted(Path(source.path).rglob("*"))
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths if p.is_file()]
    return [source.name, stats]


def tokenize_units(
    cfg: PrecomputeConfig,
    sources: list[Source],
    cache: TokenCache,
    rank: int = 0,
    world_size: int = 1,
    reader_skips: SkipLog | None = None,
    write_cache: bool = True,
    vocab_size: int | None = None,
) -> tuple[list[UnitSummary], int]:
    """Tokenize (or find in the cache) every unit this rank owns. Files that break mid-way are
    counted in `reader_skips` (`unreadable_file`; every rank reads every file, so one rank's count
    is the job's). With `write_cache` false (a dry run) units missing from the cache are tokenized
    for their summary only: nothing is written. `vocab_size`: the target config's (read when not
    given).

    -> (summaries of this rank's units in unit order,
    number of input records in the whole input)."""
    counter = _RecordCounter(
        iter_raw_records(sources, SkipLog(0) if reader_skips is None else reader_skips)
    )
    per_sort_window = cfg.batching.sort_window_units
    units = iter_unit_records(counter, cfg.run.samples_per_unit, rank, world_size, per_sort_window)
    todo = ((u, recs) for u, recs in units if not cache.has(u) or _stale(cache, u, recs))
    root = str(cache.root) if write_cache else None
    if vocab_size is None:
        vocab_size = load_text_config(cfg.target.path).vocab_size
    if cfg.run.tokenize_workers > 0:
        fresh = _tokenize_in_pool(cfg, todo, root, vocab_size)
    else:
        tokenizer = UnitTokenizer.from_target(cfg.target.path, cfg.data, vocab_size)
        fresh = {u: _tokenize_one(tokenizer, u, recs, root) for u, recs in todo}
    total_units = num_units(counter.count, cfg.run.samples_per_unit)
    mine = [u for u in range(total_units) if owner(u, world_size, per_sort_window) == rank]
    return [fresh[u] if u in fresh else cache.load(u).summary() for u in mine], counter.count


def _tokenize_one(
    tokenizer: UnitTokenizer, unit: int, records: list[RawRecord], cache_root: str | None
) -> UnitSummary:
    """Tokenize one unit, save it in the cache at
    `cache_root` (None: save nothing) -> its summary."""
    tokenized = tokenizer(unit, records)
    if cache_root is not None:
        TokenCache(Path(cache_root)).save(tokenized)
    return tokenized.summary()


def _stale(cache: TokenCache, unit: int, records: list[RawRecord]) -> bool:
    """A cached unit made from a different number of records is redone (a partial last unit)."""
    return cache.load(unit).num_records != len(records)


class _RecordCounter:
    """Passes records through and counts them (the number of units needs the whole input)."""

    def __init__(self, records: Iterator[RawRecord]):
        self.records = records
        self.count = 0

    def __iter__(self) -> Iterator[RawRecord]:
        for record in self.records:
            self.count = record.index + 1
            yield record


_WORKER: UnitTokenizer | None = None


def _worker_init(target_path: str, data: DataSection, vocab_size: int) -> None:
    global _WORKER
    logging.getLogger("dflash").setLevel(logging.ERROR)  # the main process logs the summary
    _WORKER = UnitTokenizer.from_target(target_path, data, vocab_size)


def _worker_run(unit: int, records: list[RawRecord], cache_root: str | None) -> UnitSummary:
    assert _WORKER is not None
    return _tokenize_one(_WORKER, unit, records, cache_root)


def _tokenize_in_pool(
    cfg: PrecomputeConfig, todo, cache_root: str | None, vocab_size: int
) -> dict[int, UnitSummary]:
    """Units go to a pool of processes (spawned: forking a process that holds tokenizer threads can
    deadlock); at most 2 per worker are in flight, so reading never runs far ahead of tokenizing.
    -> the summaries of the units tokenized, by unit."""
    workers = cfg.run.tokenize_workers
    ctx = multiprocessing.get_context("spawn")
    out: dict[int, UnitSummary] = {}
    with cf.ProcessPoolExecutor(
        workers,
        mp_context=ctx,
        initializer=_worker_init,
        initargs=(cfg.target.path, cfg.data, vocab_size),
    ) as pool:
        pending: set[cf.Future] = set()
        for u, recs in todo:
            pending.add(pool.submit(_worker_run, u, [r.portable() for r in recs], cache_root))
            if len(pending) >= 2 * workers:
                done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for f in done:
                    out[f.result().index] = f.result()
        for f in cf.as_completed(pending):
            out[f.result().index] = f.result()
    return out
