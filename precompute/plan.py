"""Shard names and the plan printed before any GPU work: what a run will write and whether the disk
holds it.

Shard names. Each work unit (precompute/units.py) becomes one shard whose name is derived from its
content (`unit_shard_name`): the unit index, its sample ids, token ids, loss mask, and the parts of
the configuration that change the states (`state_key`). A rerun computes the same names and skips
the shards the store already has.

Disk plan. Bytes per token on disk (H = hidden size, K = number of captured layers):
    bf16:      K * 2H            (2 bytes per value)
    fp8_e4m3:  K * (H + 4)       (1 byte per value + a float32 scale per token and layer)
    q4_hadamard: K * (9H/16 + 4) (4 bits per value, a scale byte per 16 values, a float32 per token)
    + 5                          (int32 token id + uint8 loss mask)
plus 8 bytes per sample (offsets), before compression (a projection, so an upper bound). The plan
refuses to start when the bytes still to write, plus a margin, exceed the free space on the store's
filesystem (`run.force` overrides).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Collection

from dflash_common.errors import UserError
from dflash_common.fsutil import human_bytes
from dflash_common.store import shard_name
from dflash_common.store.quant import token_bytes, token_bytes_formula
from precompute.config import PrecomputeConfig
from precompute.inputs import SkipLog
from precompute.tokenizing import UnitSummary
from precompute.units import num_units

log = logging.getLogger("dflash")

# Extra room the disk must have beyond the projection: zarr metadata, checksums, filesystem blocks.
DISK_MARGIN = 1.05
_ID_MASK_BYTES = 5  # int32 token id + uint8 loss mask per token
_OFFSET_BYTES = 8  # int64 offset per sample


# ------------------------------------------------------------------------------------ shard names


def state_key(target: Any, layer_ids: list[int], cfg: PrecomputeConfig) -> str:
    """Hash of every setting that changes the stored states of a given token sequence; `target` is
    the target's fingerprint (the manifest's `target`)."""
    key = {
        "target": target,
        "layer_ids": sorted(layer_ids),
        "dtype": cfg.target.dtype,
        "attn_implementation": cfg.target.attn_implementation,
        "store_dtype": cfg.store.dtype,
    }
    # only when set, so a store without final states names its shards as if the option did not exist
    if cfg.store.final_state:
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
    # every shard the finished store holds (units with sequences): the summary lists them, so a
    # shard lost later is named by verify, info and train
    shards: tuple[str, ...] = ()
    as_generated: int = 0  # answers taken as the target emitted them (dflash-generate's answer_ids)
    ids_unused: int = 0  # answers whose answer_ids did not spell their text: tokenized from it
    earlier_masked: int = 0  # earlier answers of multi-turn records out of the loss (context only)
    earlier_apart: int = 0  # of those, sequences of their own (data.earlier_answers = 'apart')

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
            f"({self.committed_units:,} already in the store, {len(self.empty_units):,} without a "
            "sequence)",
            f"  samples kept: {self.samples:,}; skipped {self.skips.total:,} ({skipped}); "
            f"truncated {self.truncated:,}",
            f"  tokens after templating: {self.tokens:,} (response tokens "
            f"{self.response_tokens:,})",
            *self._answer_lines(),
            f"  layers {self.layer_ids}{' + the final state' if self.final_state else ''} x hidden "
            f"{self.hidden_size} as {self.store_dtype}: "
            f"{per:,} array bytes/token ({formula} + 5 for id and mask) + 8 per sequence (offsets)",
            f"  arrays before compression: {human_bytes(self.bytes_total)}, still to write "
            f"{human_bytes(self.bytes_to_write)} (on disk add shard indexes, checksums and "
            "metadata)",
            f"  free space at {self.store_path}: {human_bytes(self.free_bytes)} -> "
            + (
                "enough"
                if self.fits
                else f"NOT enough (need {human_bytes(int(self.bytes_to_write * DISK_MARGIN))})"
            ),
        ]
        for source_id, reason, detail in self.skips.examples:
            lines.append(f"  e.g. skipped {source_id}: {reason} ({detail})")
        return "\n".join(lines)

    def _answer_lines(self) -> list[str]:
        if not (self.as_generated or self.ids_unused):
            return []
        line = (
            f"  answers as the target emitted them (dflash-generate's answer_ids): "
            f"{self.as_generated:,}"
        )
        if self.ids_unused:
            line += (
                f"; {self.ids_unused:,} tokenized from their text instead: their answer_ids do not "
                "spell it (edited since, or generated with another tokenizer)"
            )
        if self.earlier_masked:
            line += (
                f"; {self.earlier_masked:,} earlier answers of multi-turn conversations kept as "
                "context but out of the loss there: the template renders them in later turns "
                "otherwise than the target emitted them (a reasoning template drops their "
                f"thinking); {self.earlier_apart:,} of them trained as sequences of their own "
                "(data.earlier_answers)"
            )
        return [line]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["skips"] = self.skips.to_dict()
        return out


def make_plan(
    summaries: list[UnitSummary],
    records: int,
    *,
    samples_per_unit: int,
    hidden_size: int,
    layer_ids: list[int],
    store_dtype: str,
    store_path: str,
    committed: Collection[int] = (),
    report_first: int = 5,
    reader_skips: SkipLog | None = None,
    final_state: bool = False,
    shards: Collection[str] = (),
) -> Plan:
    """The plan from the unit summaries of all ranks; `committed` holds units the store already has,
    `reader_skips` the files that could not be read to their end (tokenize_units), `shards` the
    names of all units' shards."""
    arrays = len(layer_ids) + (1 if final_state else 0)  # state arrays per token
    skips, per = SkipLog(report_first), bytes_per_token(hidden_size, arrays, store_dtype)
    for s in sorted(summaries, key=lambda s: s.index):
        skips.merge(SkipLog.from_dict(s.skips, report_first))
    if reader_skips is not None:
        skips.merge(reader_skips)
    size = {s.index: s.tokens * per + (s.samples + 1) * _OFFSET_BYTES for s in summaries}
    return Plan(
        records=records,
        units=num_units(records, samples_per_unit),
        samples=sum(s.samples for s in summaries),
        tokens=sum(s.tokens for s in summaries),
        response_tokens=sum(s.response_tokens for s in summaries),
        truncated=sum(s.truncated for s in summaries),
        as_generated=sum(s.as_generated for s in summaries),
        ids_unused=sum(s.ids_unused for s in summaries),
        earlier_masked=sum(s.earlier_masked for s in summaries),
        earlier_apart=sum(s.earlier_apart for s in summaries),
        skips=skips,
        hidden_size=hidden_size,
        layer_ids=list(layer_ids),
        store_dtype=store_dtype,
        store_path=store_path,
        committed_units=len(committed),
        empty_units=sorted(s.index for s in summaries if s.samples == 0),
        bytes_total=sum(size.values()),
        bytes_to_write=sum(v for u, v in size.items() if u not in committed),
        free_bytes=free_space(store_path),
        final_state=final_state,
        shards=tuple(sorted(shards)),
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
        log.warning(
            "the store needs ~%s but %s has %s free; going on because run.force is set",
            human_bytes(plan.bytes_to_write),
            plan.store_path,
            human_bytes(plan.free_bytes),
        )
        return
    raise UserError(
        f"the store needs ~{human_bytes(int(plan.bytes_to_write * DISK_MARGIN))} but "
        f"{plan.store_path} has {human_bytes(plan.free_bytes)} free; free space, choose "
        "store.dtype = 'fp8_e4m3' (half the size), or pass --run.force=true."
    )


def check_samples(plan: Plan, input_names: str) -> None:
    """Refuse a job whose input yields no sequence at all (every record skipped, or none): its store
    would hold nothing to train from. The sentence counts the skips by reason and names the first
    few."""
    if plan.samples:
        return
    if not plan.records and not plan.skips.total:
        raise UserError(
            f"data.inputs ({input_names}) hold no record; give files with one JSON record per line "
            "(or a saved dataset); no store was created."
        )
    counts = ", ".join(f"{reason} {n:,}" for reason, n in sorted(plan.skips.counts.items()))
    first = "; ".join(f"{source_id}: {reason}" for source_id, reason, _ in plan.skips.examples)
    raise UserError(
        f"every one of the {plan.records:,} input records of {input_names} was skipped ({counts}), "
        f"e.g. {first}; fix the inputs (or data.format, data.max_length, data.block_size, which "
        "decide the skips) and rerun; no store was created."
    )
