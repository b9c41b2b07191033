"""Work units, their tokens, who computes them, and the plan printed before any GPU work.

Work units. The input record stream (every line or row of every input, in input order, bad ones
included) is cut into units of `run.samples_per_unit` consecutive records: unit u holds records
[u*S, (u+1)*S). Units depend on the input alone, never on the number of ranks. Consecutive units
form windows of `batching.sort_window_units` (window w = units [w*W, (w+1)*W)), whose samples are
sorted by length and batched together; rank r computes the windows with w % world_size == r. As a
window is batched the same way whatever the number of ranks, every sequence runs in the same batch
and its states are the same bits with 1 rank or 100. Each unit becomes one shard whose name is
derived from its content (`unit_shard_name`): the unit index, its sample ids, token ids, loss mask,
and the parts of the configuration that change the states (`state_key`). A rerun computes the same
names and skips the shards the store already has.

Tokenize once. Applying the chat template is the slow part of reading (a Jinja render per turn).
The plan needs the token counts, so the plan pass tokenizes each rank's units and keeps the result in
a token cache (`run.cache_dir`, default `<store.path>.tokens/<key>/unit-XXXXXXXX.npz`, 5 bytes per
token); the forward pass then reads the cache instead of tokenizing again, and a restarted run finds
the units already tokenized. A `--dry-run` reads the cache where it exists but writes nothing: units
it does not find are tokenized for the plan's counts and dropped. The cache key hashes the
tokenizer files, the data options and the input files' sizes and modification times, so changed
inputs or options never reuse stale tokens. Units can be tokenized by a pool of processes
(`run.tokenize_workers`).

Disk plan. Bytes per token on disk (H = hidden size, K = number of captured layers):
    bf16:      K * 2H            (2 bytes per value)
    fp8_e4m3:  K * (H + 4)       (1 byte per value + a float32 scale per token and layer)
    q4_hadamard: K * (9H/16 + 4) (4 bits per value, a scale byte per 16 values, a float32 per token)
    + 5                          (int32 token id + uint8 loss mask)
plus 8 bytes per sample (offsets), before compression (a projection, so an upper bound). The plan
refuses to start when the bytes still to write, plus a margin, exceed the free space on the store's
filesystem (`run.force` overrides).

Skip reasons added here (see precompute/inputs.py for the reader's): the chat template's
(`template_error`, `template_rewrites_history`, `assistant_turn_first`), `token_id_out_of_range`,
`too_long` (with data.overlength = 'drop') and `too_few_response_tokens` (< 2 x data.block_size).
Truncated sequences are kept and counted as `truncated`.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import io
import json
import logging
import multiprocessing
import shutil
from pathlib import Path
from typing import Any, Collection, Iterator

import numpy as np

from dflash_common.chat import ChatMaskError, ChatTemplate
from dflash_common.cli import UserError
from dflash_common.fingerprint import chat_template_sha256, tokenizer_fingerprint
from dflash_common.fsutil import atomic_write_bytes, human_bytes
from dflash_common.store import shard_name
from dflash_common.store.quant import token_bytes, token_bytes_formula
from precompute.config import DataConfig, PrecomputeConfig
from precompute.inputs import Conversation, RawRecord, SkipLog, Source, iter_raw_records, parse_or_skip

log = logging.getLogger("dflash")

# Bumped when the tokenization rules change, so caches made by older code are not reused.
# 2: no loss on the end of turn of a record cut by length (finish_reason); 3: sample ids name a file by
# its own name, not its path (inputs.Source.label), so shard names no longer change when inputs move
TOKENIZE_VERSION = 3
# Extra room the disk must have beyond the projection: zarr metadata, checksums, filesystem blocks.
DISK_MARGIN = 1.05
_ID_MASK_BYTES = 5  # int32 token id + uint8 loss mask per token
_OFFSET_BYTES = 8  # int64 offset per sample


# ------------------------------------------------------------------------------------ work units


def owner(unit: int, world_size: int, units_per_window: int = 1) -> int:
    """The rank that computes `unit`: the owner of its window (windows go round-robin)."""
    return (unit // units_per_window) % world_size


def num_units(num_records: int, samples_per_unit: int) -> int:
    return -(-num_records // samples_per_unit)


def iter_unit_records(records: Iterator[RawRecord], samples_per_unit: int, rank: int = 0,
                      world_size: int = 1, units_per_window: int = 1) -> Iterator[tuple[int, list[RawRecord]]]:
    """Group the record stream into (unit index, records) for the units this rank owns. Records of
    other ranks' units are passed over without being kept or parsed."""
    current, batch = -1, []
    for record in records:
        unit = record.index // samples_per_unit
        if unit != current:
            if batch:
                yield current, batch
            current, batch = unit, []
        if owner(unit, world_size, units_per_window) == rank:
            batch.append(record)
    if batch:
        yield current, batch


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

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def content_digest(self) -> str:
        """Hash of what the unit holds (ids, tokens, mask, boundaries), the base of its shard name."""
        h = hashlib.sha256(f"unit {self.index}\0".encode())
        h.update("\0".join(self.sample_ids).encode())
        for array in (self.offsets, self.input_ids, self.loss_mask):
            h.update(np.ascontiguousarray(array).tobytes())
        return h.hexdigest()

    def summary(self) -> "UnitSummary":
        return UnitSummary(self.index, self.num_records, self.num_samples, self.num_tokens,
                           int(self.loss_mask.sum()), self.truncated, self.skips.to_dict(), self.content_digest())

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        meta = {"index": self.index, "num_records": self.num_records, "truncated": self.truncated,
                "skips": self.skips.to_dict(), "sample_ids": self.sample_ids}
        np.savez(buf, input_ids=self.input_ids, loss_mask=self.loss_mask, offsets=self.offsets,
                 meta=np.array(json.dumps(meta)))
        return buf.getvalue()

    @classmethod
    def from_file(cls, path: str | Path, report_first: int = 5) -> "TokenizedUnit":
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            return cls(meta["index"], meta["num_records"], z["input_ids"], z["loss_mask"], z["offsets"],
                       meta["sample_ids"], SkipLog.from_dict(meta["skips"], report_first), meta["truncated"])


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


# ------------------------------------------------------------------------------------ tokenizing


class UnitTokenizer:
    """Records of a unit -> TokenizedUnit, applying the chat template and the length rules."""

    def __init__(self, chat: ChatTemplate, data: DataConfig, vocab_size: int):
        self.chat = chat
        self.data = data
        self.vocab_size = vocab_size

    @classmethod
    def from_target(cls, target_path: str, data: DataConfig) -> "UnitTokenizer":
        from transformers import AutoTokenizer

        from precompute.target import read_text_config

        try:
            tokenizer = AutoTokenizer.from_pretrained(target_path)
        except (OSError, ValueError) as e:
            raise UserError(f"target.path {target_path} has no usable tokenizer ({e}).") from e
        # Pre-tokenized ids must index the embedding, which may have more rows than the tokenizer
        # has tokens (padded vocabularies; targets that emit ids the tokenizer cannot spell).
        vocab = max(len(tokenizer), read_text_config(target_path).vocab_size)
        return cls(ChatTemplate(tokenizer, data.chat_template_kwargs), data, vocab)

    def __call__(self, index: int, records: list[RawRecord]) -> TokenizedUnit:
        skips, truncated = SkipLog(self.data.report_first), 0
        ids, masks, sample_ids = [], [], []
        for record in records:
            sample = self._sample(record, skips)
            if sample is None:
                continue
            (tokens, mask), cut = sample
            ids.append(tokens)
            masks.append(mask)
            sample_ids.append(record.source_id)
            truncated += cut
        offsets = np.zeros(len(ids) + 1, np.int64)
        offsets[1:] = np.cumsum([len(t) for t in ids])
        cat = (lambda xs, dt: np.concatenate(xs).astype(dt, copy=False) if xs else np.zeros(0, dt))
        return TokenizedUnit(index, len(records), cat(ids, np.int32), cat(masks, np.uint8), offsets,
                             sample_ids, skips, truncated)

    def _sample(self, record: RawRecord, skips: SkipLog):
        """-> ((input_ids, loss_mask), was_truncated) or None (counted in skips)."""
        parsed = parse_or_skip(record, self.data.format, skips)
        if parsed is None:
            return None
        try:
            ids, mask = self._tokens(parsed)
        except ChatMaskError as e:
            skips.add(record.source_id, e.reason, e.detail)
            return None
        cut = len(ids) > self.data.max_length
        if cut and self.data.overlength == "drop":
            skips.add(record.source_id, "too_long", f"{len(ids)} tokens > data.max_length {self.data.max_length}")
            return None
        ids, mask = ids[: self.data.max_length], mask[: self.data.max_length]
        if int(mask.sum()) < 2 * self.data.block_size:
            skips.add(record.source_id, "too_few_response_tokens",
                      f"{int(mask.sum())} response tokens < 2 x data.block_size {self.data.block_size}")
            return None
        return (ids, mask), int(cut)

    def _tokens(self, parsed) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(parsed, Conversation):
            return self.chat.tokenize(parsed.messages, parsed.last_turn_cut)
        ids = np.asarray(parsed.input_ids, np.int64)
        if ids.max() >= self.vocab_size:
            raise ChatMaskError("token_id_out_of_range",
                                f"token id {int(ids.max())} >= the target's {self.vocab_size} embeddings")
        return ids.astype(np.int32), np.asarray(parsed.loss_mask, np.uint8)


# ------------------------------------------------------------------------------------ token cache


class TokenCache:
    """Tokenized units on disk, under a directory named by everything that decides their tokens."""

    def __init__(self, root: Path, report_first: int = 5):
        self.root = root
        self.report_first = report_first

    @classmethod
    def for_config(cls, cfg: PrecomputeConfig, sources: list[Source],
                   tokenizer: dict[str, Any] | None = None) -> "TokenCache":
        """The cache of this config's units; `tokenizer` is `tokenizer_identity(cfg.target.path)`
        (computed here when not given)."""
        base = Path(cfg.run.cache_dir or f"{cfg.store.path.rstrip('/')}.tokens")
        key = {
            "version": TOKENIZE_VERSION,
            "tokenizer": tokenizer if tokenizer is not None else tokenizer_identity(cfg.target.path),
            "data": {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in ("inputs", "report_first")},
            "samples_per_unit": cfg.run.samples_per_unit,
            "sources": [_source_stamp(s) for s in sources],
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
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
        """Remove what saves cut by a kill left behind (hidden temporary files, never read); -> how many.
        Call it only when no process of the job writes the cache any more."""
        leftovers = list(self.root.glob(".unit-*.tmp-*")) if self.root.is_dir() else []
        for path in leftovers:
            path.unlink(missing_ok=True)
        return len(leftovers)


def tokenizer_identity(target_path: str) -> dict[str, Any]:
    """What decides the tokens of a conversation: the tokenizer's vocabulary and special tokens and
    the chat template (the store manifest's fingerprints of them)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(target_path)
    except (OSError, ValueError) as e:
        raise UserError(f"target.path {target_path} has no usable tokenizer ({e}).") from e
    return {"tokenizer": tokenizer_fingerprint(tokenizer), "chat_template_sha256": chat_template_sha256(tokenizer)}


def _source_stamp(source: Source) -> list[Any]:
    paths = [Path(source.path)] if source.kind == "jsonl" else sorted(Path(source.path).rglob("*"))
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths if p.is_file()]
    return [source.name, stats]


def tokenize_units(cfg: PrecomputeConfig, sources: list[Source], cache: TokenCache, rank: int = 0,
                   world_size: int = 1, reader_skips: SkipLog | None = None,
                   write_cache: bool = True) -> tuple[list[UnitSummary], int]:
    """Tokenize (or find in the cache) every unit this rank owns. Files that break mid-way are counted
    in `reader_skips` (`unreadable_file`; every rank reads every file, so one rank's count is the job's).
    With `write_cache` false (a dry run) units missing from the cache are tokenized for their summary
    only: nothing is written.

    -> (summaries of this rank's units in unit order, number of input records in the whole input)."""
    counter = _RecordCounter(iter_raw_records(sources, SkipLog(0) if reader_skips is None else reader_skips))
    window = cfg.batching.sort_window_units
    units = iter_unit_records(counter, cfg.run.samples_per_unit, rank, world_size, window)
    todo = ((u, recs) for u, recs in units if not cache.has(u) or _stale(cache, u, recs))
    root = str(cache.root) if write_cache else None
    if cfg.run.tokenize_workers > 0:
        fresh = _tokenize_in_pool(cfg, todo, root)
    else:
        tokenizer = UnitTokenizer.from_target(cfg.target.path, cfg.data)
        fresh = {u: _tokenize_one(tokenizer, u, recs, root) for u, recs in todo}
    total_units = num_units(counter.count, cfg.run.samples_per_unit)
    mine = [u for u in range(total_units) if owner(u, world_size, window) == rank]
    return [fresh[u] if u in fresh else cache.load(u).summary() for u in mine], counter.count


def _tokenize_one(tokenizer: UnitTokenizer, unit: int, records: list[RawRecord],
                  cache_root: str | None) -> UnitSummary:
    """Tokenize one unit, save it in the cache at `cache_root` (None: save nothing) -> its summary."""
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


def _worker_init(target_path: str, data: DataConfig) -> None:
    global _WORKER
    logging.getLogger("dflash").setLevel(logging.ERROR)  # the main process logs the summary
    _WORKER = UnitTokenizer.from_target(target_path, data)


def _worker_run(unit: int, records: list[RawRecord], cache_root: str | None) -> UnitSummary:
    assert _WORKER is not None
    return _tokenize_one(_WORKER, unit, records, cache_root)


def _tokenize_in_pool(cfg: PrecomputeConfig, todo, cache_root: str | None) -> dict[int, UnitSummary]:
    """Units go to a pool of processes (spawned: forking a process that holds tokenizer threads can
    deadlock); at most 2 per worker are in flight, so reading never runs far ahead of tokenizing.
    -> the summaries of the units tokenized, by unit."""
    workers = cfg.run.tokenize_workers
    ctx = multiprocessing.get_context("spawn")
    out: dict[int, UnitSummary] = {}
    with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                                initargs=(cfg.target.path, cfg.data)) as pool:
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


# ------------------------------------------------------------------------------------ shard names


def state_key(target: Any, layer_ids: list[int], cfg: PrecomputeConfig) -> str:
    """Hash of every setting that changes the stored states of a given token sequence; `target` is
    the target's fingerprint (the manifest's `target`)."""
    key = {"target": target, "layer_ids": sorted(layer_ids), "dtype": cfg.target.dtype,
           "attn_implementation": cfg.target.attn_implementation, "store_dtype": cfg.store.dtype}
    if cfg.store.final_state:  # only when set: the names of stores without final states stay as they were
        key["final_state"] = True
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def unit_shard_name(unit: int, content_digest: str, state: str) -> str:
    """The store's name for a unit's shard (`u00000042-<16 hex>`): ordered by input position, with a
    digest of the state settings and the unit's content (`TokenizedUnit.content_digest`)."""
    return shard_name(unit, hashlib.sha256((state + content_digest).encode()).hexdigest())


# ------------------------------------------------------------------------------------ disk plan


def bytes_per_token(hidden_size: int, num_layers: int, store_dtype: str) -> int:
    return num_layers * token_bytes(store_dtype, hidden_size) + _ID_MASK_BYTES


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run will do and need, summed over all ranks' units."""

    records: int
    units: int
    samples: int
    tokens: int
    response_tokens: int
    truncated: int
    skips: SkipLog
    hidden_size: int
    layer_ids: list[int]
    store_dtype: str
    store_path: str
    committed_units: int
    empty_units: list[int]  # units whose records were all skipped: done, with no shard
    bytes_to_write: int
    bytes_total: int
    free_bytes: int
    final_state: bool = False  # one more [T, H] array per shard: the final normed state

    @property
    def state_arrays(self) -> int:
        return len(self.layer_ids) + (1 if self.final_state else 0)

    @property
    def fits(self) -> bool:
        return self.bytes_to_write * DISK_MARGIN <= self.free_bytes

    def format(self) -> str:
        skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(self.skips.counts.items())) or "none"
        per = bytes_per_token(self.hidden_size, self.state_arrays, self.store_dtype)
        formula = f"{self.state_arrays} x {token_bytes_formula(self.store_dtype, self.hidden_size)}"
        lines = [
            f"plan: {self.records:,} input records -> {self.units:,} work units "
            f"({self.committed_units:,} already in the store, {len(self.empty_units):,} without a sequence)",
            f"  samples kept: {self.samples:,}; skipped {self.skips.total:,} ({skipped}); "
            f"truncated {self.truncated:,}",
            f"  tokens after templating: {self.tokens:,} (response tokens {self.response_tokens:,})",
            f"  layers {self.layer_ids}{' + the final state' if self.final_state else ''} x hidden "
            f"{self.hidden_size} as {self.store_dtype}: "
            f"{per:,} array bytes/token ({formula} + 5 for id and mask) + 8 per sequence (offsets)",
            f"  arrays before compression: {human_bytes(self.bytes_total)}, still to write "
            f"{human_bytes(self.bytes_to_write)} (on disk add shard indexes, checksums and metadata)",
            f"  free space at {self.store_path}: {human_bytes(self.free_bytes)} -> "
            + ("enough" if self.fits else f"NOT enough (need {human_bytes(int(self.bytes_to_write * DISK_MARGIN))})"),
        ]
        for source_id, reason, detail in self.skips.examples:
            lines.append(f"  e.g. skipped {source_id}: {reason} ({detail})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["skips"] = self.skips.to_dict()
        return out


def make_plan(summaries: list[UnitSummary], records: int, *, samples_per_unit: int, hidden_size: int,
              layer_ids: list[int], store_dtype: str, store_path: str, committed: Collection[int] = (),
              report_first: int = 5, reader_skips: SkipLog | None = None, final_state: bool = False) -> Plan:
    """The plan from the unit summaries of all ranks; `committed` holds units the store already has,
    `reader_skips` the files that could not be read to their end (tokenize_units)."""
    arrays = len(layer_ids) + (1 if final_state else 0)  # state arrays per token
    skips, per = SkipLog(report_first), bytes_per_token(hidden_size, arrays, store_dtype)
    for s in sorted(summaries, key=lambda s: s.index):
        skips.merge(SkipLog.from_dict(s.skips, report_first))
    if reader_skips is not None:
        skips.merge(reader_skips)
    size = {s.index: s.tokens * per + (s.samples + 1) * _OFFSET_BYTES for s in summaries}
    return Plan(
        records=records, units=num_units(records, samples_per_unit),
        samples=sum(s.samples for s in summaries), tokens=sum(s.tokens for s in summaries),
        response_tokens=sum(s.response_tokens for s in summaries),
        truncated=sum(s.truncated for s in summaries), skips=skips, hidden_size=hidden_size,
        layer_ids=list(layer_ids), store_dtype=store_dtype, store_path=store_path,
        committed_units=len(committed), empty_units=sorted(s.index for s in summaries if s.samples == 0),
        bytes_total=sum(size.values()),
        bytes_to_write=sum(v for u, v in size.items() if u not in committed),
        free_bytes=free_space(store_path), final_state=final_state,
    )


def free_space(path: str) -> int:
    """Free bytes on the filesystem that holds `path` (or would, once created)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def check_disk(plan: Plan, force: bool) -> None:
    """Refuse to start a run the disk cannot hold, unless forced."""
    if plan.fits:
        return
    if force:
        log.warning("the store needs ~%s but %s has %s free; going on because run.force is set",
                    human_bytes(plan.bytes_to_write), plan.store_path, human_bytes(plan.free_bytes))
        return
    raise UserError(
        f"the store needs ~{human_bytes(int(plan.bytes_to_write * DISK_MARGIN))} but {plan.store_path} has "
        f"{human_bytes(plan.free_bytes)} free; free space, choose store.dtype = 'fp8_e4m3' (half the size), "
        "or pass --run.force=true.")


def check_samples(plan: Plan, input_names: str) -> None:
    """Refuse a job whose input yields no sequence at all (every record skipped, or none): its store
    would hold nothing to train from. The sentence counts the skips by reason and names the first few."""
    if plan.samples:
        return
    if not plan.records and not plan.skips.total:
        raise UserError(f"data.inputs ({input_names}) hold no record; give files with one JSON record per line "
                        "(or a saved dataset); no store was created.")
    counts = ", ".join(f"{reason} {n:,}" for reason, n in sorted(plan.skips.counts.items()))
    first = "; ".join(f"{source_id}: {reason}" for source_id, reason, _ in plan.skips.examples)
    raise UserError(
        f"every one of the {plan.records:,} input records of {input_names} was skipped ({counts}), e.g. {first}; "
        "fix the inputs (or data.format, data.max_length, data.block_size, which decide the skips) and rerun; "
        "no store was created.")
