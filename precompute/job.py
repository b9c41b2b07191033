"""One `dflash-precompute` job, on every rank: manifest, plan, target, pipeline, summary.

    rank 0 fingerprints the target, tokenizer and inputs once -> the manifest, sent to every rank
    every rank tokenizes its sort windows of work units (or finds them in the token cache)
    the ranks' unit summaries are gathered -> the plan (samples, tokens, bytes, free space),
      printed by rank 0; rank 0 decides whether the disk is big enough, every rank obeys;
      --dry-run stops here
    every rank loads the target (truncated) and runs its sort windows through the pipeline
    the ranks' statistics are gathered (a barrier) -> rank 0 writes the summary into the store

Distribution: one process per GPU under torchrun (LOCAL_RANK picks the GPU; NCCL on GPUs, gloo on
CPUs), any number of nodes. Sort windows of `batching.sort_window_units` units go round-robin to the
ranks (precompute/units.py), so the set of shards, their names and their bytes do not depend on the
number of ranks.

Resume: a unit whose shard is published is done, and so is a unit whose records were all skipped
(it has no sequences, hence no shard; the summary lists it under `empty_units`, and every rerun
knows it from the token cache without running anything). A sort window is computed when any of its
units is not done, and then whole, so that its batches, and therefore the bits of the units it
writes, are those of an uninterrupted run; units already published are not written again. A job
killed at any point resumes by running the same command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from dflash_common.cli import RateBar, write_run_record
from dflash_common.dirlock import LOCK_FILE, hold_directory
from dflash_common.dist import WINDOWS_TIMEOUT, Ranks, run_on_ranks
from dflash_common.errors import UserError
from dflash_common.fingerprint import dataset_fingerprint, head_fingerprint, target_fingerprint
from dflash_common.fsutil import check_writable, first_missing, human_bytes
from dflash_common.hf import load_text_config
from dflash_common.store import Store, StoreManifest, StoreWriter, published_shard_names, shard_unit
from dflash_common.store.contents import disk_bytes, precompute_record
from dflash_common.store.format import read_root_attributes
from dflash_common.store.quant import check_hidden_size
from dflash_common.store.writer import check_store_place
from precompute.config import PrecomputeConfig
from precompute.inputs import SkipLog, Source, resolve_inputs
from precompute.pipeline import Pipeline, PipelineStats, UnitWork, run_sort_windows
from precompute.plan import Plan, check_disk, check_samples, make_plan, state_key, unit_shard_name
from precompute.target import load_target, resolve_layer_ids
from precompute.tokenizing import (
    TOKENIZE_VERSION,
    TokenCache,
    UnitSummary,
    tokenize_units,
    tokenizer_identity,
)

log = logging.getLogger("dflash")


def run(cfg: PrecomputeConfig) -> Path:
    """Run (or resume) the precompute job `cfg` describes; returns the store's path."""
    check_store_outputs(cfg)

    def full(why: str) -> str:
        return (
            f"the filesystem of {cfg.store.path} is full ({why}); free space and rerun the same "
            "command: published shards are kept and the job resumes."
        )

    with (
        run_on_ranks(cfg.run.device, full_disk=full, timeout=WINDOWS_TIMEOUT) as ranks,
        contextlib.ExitStack() as stack,
    ):
        hold = StoreHold(stack)
        ranks.from_main(lambda: hold.take(cfg, existing_only=True))
        return _run(cfg, ranks, hold)


@dataclasses.dataclass
class StoreHold:
    """Rank 0's hold on the store for the rest of the job (its other ranks share it): a second job
    into the store is refused before it writes anything. An existing store is held from the start,
    a new one (or an empty directory) from just before it is created (a refused or dry run leaves
    nothing behind)."""

    stack: contextlib.ExitStack
    held: bool = False

    def take(self, cfg: PrecomputeConfig, existing_only: bool = False) -> None:
        path = _store_path(cfg)
        # early, only a store (or one being made) is held: no lock file lands in a user's directory
        begun = (path / "zarr.json").is_file() or (path / LOCK_FILE).is_file()
        if (
            self.held
            or cfg.run.dry_run
            or (path.exists() and not path.is_dir())
            or (existing_only and not begun)
        ):
            return  # a dry run writes nothing; a file: create_or_open says so
        self.stack.enter_context(
            hold_directory(
                path,
                "store",
                "wait for that dflash-precompute to end (or stop "
                "it), then rerun this command: it resumes",
            )
        )
        self.held = True


def _run(cfg: PrecomputeConfig, ranks: Ranks, hold: StoreHold) -> Path:
    started = time.perf_counter()
    store_path = _store_path(cfg)
    text_config = load_text_config(_target_path(cfg))  # read once, passed on
    layer_ids = resolve_layer_ids(cfg.target.layer_ids, text_config.num_hidden_layers)
    sources = resolve_inputs(cfg.data.inputs)
    manifest, fresh_cache = ranks.from_main(
        lambda: identity(cfg, store_path, sources, layer_ids, text_config.hidden_size)
    )
    check_store_place(store_path)  # a file or another directory: refused before any work
    if (store_path / "zarr.json").is_file():
        StoreWriter.create_or_open(
            store_path, manifest
        )  # refuses a store made otherwise, before any work
    try:
        plan, mine = make_job_plan(cfg, ranks, sources, manifest, text_config.vocab_size)
        if ranks.main:
            print(plan.format(), flush=True)
        ranks.from_main(lambda: check_samples(plan, ", ".join(cfg.data.inputs)))
        ranks.from_main(lambda: check_disk(plan, cfg.run.force))
    except UserError:
        if ranks.main and fresh_cache is not None:  # a refused run leaves nothing it created
            shutil.rmtree(fresh_cache, ignore_errors=True)
        raise
    if cfg.run.dry_run:
        return store_path
    ranks.from_main(lambda: hold.take(cfg))  # a new store: from here on
    writer = StoreWriter.create_or_open(store_path, manifest)
    if ranks.main:
        write_run_record(store_path.parent, cfg, name=precompute_record(store_path).stem)
    planned = time.perf_counter()
    stats, load_s = _compute(cfg, ranks, text_config, layer_ids, writer, mine)
    done = time.perf_counter()
    everyone = ranks.gather(stats)  # also the barrier: every rank's shards are published
    if ranks.main:
        mine.cache.remove_leftovers()  # of killed runs; no rank writes the cache any more
        timings = {
            "plan": planned - started,
            "load_target": load_s,
            "staging_setup": stats.setup_s,
            "forward_write": done - planned - load_s - stats.setup_s,
            "total": done - started,
        }
        summary = make_summary(plan, everyone, timings, Store.open(store_path).summary, ranks.world)
        writer.write_summary(summary)
        print(format_summary(summary, disk_bytes(store_path)), flush=True)
    return store_path


def check_store_outputs(cfg: PrecomputeConfig) -> None:
    """The store, what is written beside it (the run record, the token cache) and run.cache_dir must
    be writable: one sentence before any work, a dry run included (its plan must not call a place it
    cannot write 'enough')."""
    fix = "pass --out a new directory or a dflash store, on a writable filesystem"
    check_writable(_store_path(cfg), "store.path", fix, beside=True)
    if cfg.run.cache_dir:
        check_writable(
            cfg.run.cache_dir, "run.cache_dir", "pass a writable directory, or leave it unset"
        )


def identity(
    cfg: PrecomputeConfig,
    store_path: Path,
    sources: list[Source],
    layer_ids: list[int],
    hidden_size: int,
) -> tuple[StoreManifest, Path | None]:
    """Rank 0: the store's manifest, and the top directory of the token cache this run will create
    (None when it exists), found before any rank can write the cache."""
    manifest = build_manifest(cfg, sources, layer_ids, hidden_size)
    manifest = adopt_stored_identity(store_path, manifest)
    tokenizer = {
        "tokenizer": manifest.tokenizer,
        "chat_template_sha256": manifest.chat_template_sha256,
    }
    return manifest, first_missing(TokenCache.for_config(cfg, sources, tokenizer).root)


def _store_path(cfg: PrecomputeConfig) -> Path:
    if not cfg.store.path.strip():
        raise UserError(
            "store.path is not set; pass --out STORE (a new or an existing store directory)."
        )
    return Path(cfg.store.path)


def _target_path(cfg: PrecomputeConfig) -> str:
    if not cfg.target.path.strip():
        raise UserError(
            "target.path is not set; pass --target.path=DIR, a local checkpoint directory."
        )
    return cfg.target.path


# ---------------------------------------------------------------------------------------- manifest


def build_manifest(
    cfg: PrecomputeConfig, sources: list[Source], layer_ids: list[int], hidden_size: int
) -> StoreManifest:
    """The store's manifest: fingerprints and the settings that shape its content. Nothing in it
    depends on paths, the number of ranks or the clock, so every rank and every rerun agrees."""
    try:
        check_hidden_size(cfg.store.dtype, hidden_size)
    except ValueError as e:
        raise UserError(f"{e} (the target's hidden size is {hidden_size}).") from None
    tokenizer = tokenizer_identity(cfg.target.path)
    inputs = list(dict.fromkeys(s.path for s in sources))  # a dataset's splits share one directory
    return StoreManifest(
        target=target_fingerprint(cfg.target.path),
        tokenizer=tokenizer["tokenizer"],
        chat_template_sha256=tokenizer["chat_template_sha256"],
        layer_ids=tuple(layer_ids),
        hidden_size=hidden_size,
        dtype=cfg.store.dtype,
        codec=cfg.store.codec,
        dataset=dataset_fingerprint(inputs),
        precompute=content_settings(cfg),
        final_state=cfg.store.final_state,
        target_head=head_fingerprint(cfg.target.path),
    )


def adopt_stored_identity(store_path: Path, manifest: StoreManifest) -> StoreManifest:
    """Identity is content: a target whose fingerprint equals the store's in everything but its
    name (the directory's basename) is the store's target, so the store's own record is used (its
    shard names derive from it). A store written before `target_head` was recorded keeps none."""
    try:
        stored = read_root_attributes(store_path) if (store_path / "zarr.json").is_file() else None
    except UserError:
        return manifest  # unreadable: create_or_open says so in its sentence
    if not stored:
        return manifest
    target = stored.get("target")
    unnamed = lambda fp: {k: v for k, v in fp.items() if k != "name"}  # noqa: E731
    if isinstance(target, dict) and unnamed(target) == unnamed(manifest.target):
        manifest = dataclasses.replace(manifest, target=target)
    if "target_head" not in stored:
        manifest = dataclasses.replace(manifest, target_head={})
    return manifest


def content_settings(cfg: PrecomputeConfig) -> dict[str, Any]:
    """The config fields that change what the store holds (the manifest's `precompute` table).

    Left out: paths (they differ between machines), the device and thread counts, and the batching
    knobs, which decide speed and memory; batches are formed the same way on every run of a config,
    so a resume keeps them, and changing them between runs changes states at the rounding level."""
    data = {
        k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in ("inputs", "report_first")
    }
    return {
        "target": {
            "dtype": cfg.target.dtype,
            "attn_implementation": cfg.target.attn_implementation,
        },
        "data": data,
        "run": {"samples_per_unit": cfg.run.samples_per_unit},
        "tokenize_version": TOKENIZE_VERSION,
    }


# ---------------------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class RankUnits:
    """This rank's units: summaries, shard names (units
    with sequences) and those already published."""

    summaries: list[UnitSummary]
    names: dict[int, str]
    committed: set[int]
    cache: TokenCache


def make_job_plan(
    cfg: PrecomputeConfig,
    ranks: Ranks,
    sources: list[Source],
    manifest: StoreManifest,
    vocab_size: int,
) -> tuple[Plan, RankUnits]:
    """Tokenize this rank's units (once: the token cache), find the published ones, and gather the
    plan of the whole job from every rank. `vocab_size`: the target's embedding rows."""
    cache = TokenCache.for_config(
        cfg,
        sources,
        {"tokenizer": manifest.tokenizer, "chat_template_sha256": manifest.chat_template_sha256},
    )
    reader_skips = SkipLog(cfg.data.report_first)
    summaries, records = tokenize_units(
        cfg,
        sources,
        cache,
        ranks.rank,
        ranks.world,
        reader_skips,
        write_cache=not cfg.run.dry_run,  # a dry run writes nothing
        vocab_size=vocab_size,
    )
    state = state_key(manifest.target, list(manifest.layer_ids), cfg)
    names = {s.index: unit_shard_name(s.index, s.digest, state) for s in summaries if s.samples}
    # listed without the root metadata: a store whose cut zarr.json was deleted (as the error says
    # to) keeps its shards; names derive from content and state settings, so a name found is this
    # run's shard
    published = set(published_shard_names(cfg.store.path))
    committed = {u for u, name in names.items() if name in published}
    gathered = ranks.gather(
        (summaries, committed, reader_skips.to_dict(), other_copies(names, published))
    )
    refuse_other_copies(
        cfg.store.path, [c for part in gathered for c in part[3]]
    )  # every rank, the same sentence
    everyone = [s for part, _, _, _ in gathered for s in part]
    plan = make_plan(
        everyone,
        records,
        samples_per_unit=cfg.run.samples_per_unit,
        hidden_size=manifest.hidden_size,
        layer_ids=list(manifest.layer_ids),
        store_dtype=manifest.dtype,
        store_path=cfg.store.path,
        committed=set().union(*(c for _, c, _, _ in gathered)),
        report_first=cfg.data.report_first,
        reader_skips=SkipLog.from_dict(gathered[0][2], cfg.data.report_first),  # read by every rank
        final_state=manifest.final_state,
        shards=[unit_shard_name(s.index, s.digest, state) for s in everyone if s.samples],
    )
    return plan, RankUnits(summaries, names, committed, cache)


def other_copies(names: dict[int, str], published: set[str]) -> list[tuple[int, str, str]]:
    """(unit, published name, this run's name) of each of this rank's units published under another
    name: a shard made from other records (other data, or by a version whose sample ids carried
    paths). Writing this run's shard beside it would leave the unit twice, and training reads
    both."""
    return [
        (unit, name, names[unit])
        for name in sorted(published)
        if (unit := shard_unit(name)) in names and names[unit] != name
    ]


def refuse_other_copies(store: str, copies: list[tuple[int, str, str]]) -> None:
    if copies:
        unit, old, new = min(copies)
        more = f" (and {len(copies) - 1} more units)" if len(copies) > 1 else ""
        raise UserError(
            f"store {store} already holds work unit {unit} as shard {old}{more}, and this run "
            f"would write it as {new} from other records; precompute into a new store, or remove "
            "the shards this run's inputs did not make."
        )


# ---------------------------------------------------------------------------------------- compute


def my_sort_windows(units: RankUnits, units_per_sort_window: int) -> list[list[int]]:
    """This rank's sort windows (unit indices) that hold a unit still to write."""
    sort_windows: dict[int, list[int]] = {}
    for s in units.summaries:
        sort_windows.setdefault(s.index // units_per_sort_window, []).append(s.index)
    todo = lambda u: u in units.names and u not in units.committed  # noqa: E731
    return [w for _, w in sorted(sort_windows.items()) if any(todo(u) for u in w)]


def _load_sort_windows(units: RankUnits, sort_windows: list[list[int]]) -> Iterator[list[UnitWork]]:
    """Each sort window's units from the token cache, loaded when the sort window comes up."""
    for sort_window in sort_windows:
        yield [
            UnitWork(units.cache.load(u), None if u in units.committed else units.names.get(u))
            for u in sort_window
        ]


def _compute(
    cfg: PrecomputeConfig,
    ranks: Ranks,
    text_config: Any,
    layer_ids: list[int],
    writer: StoreWriter,
    units: RankUnits,
) -> tuple[PipelineStats, float]:
    """Load the target and run this rank's sort windows -> (statistics, seconds spent loading)."""
    sort_windows = my_sort_windows(units, cfg.batching.sort_window_units)
    samples = {s.index: s.samples for s in units.summaries}
    total = sum(samples[u] for w in sort_windows for u in w)
    log.info(
        "%d sort windows of %d work units to compute (%d samples); %d units of this rank "
        "already in the store",
        len(sort_windows),
        sum(len(w) for w in sort_windows),
        total,
        len(units.committed),
    )
    if not sort_windows:
        return PipelineStats(), 0.0  # nothing left here: the target is not even loaded
    started = time.perf_counter()
    target = load_target(
        cfg.target.path,
        layer_ids,
        dtype=cfg.target.dtype,
        attn_implementation=cfg.target.attn_implementation,
        device=ranks.device,
        final_state=cfg.store.final_state,
        compile=cfg.target.compile,
        text_config=text_config,
    )
    load_s = time.perf_counter() - started
    with (
        _cpu_core_for_writers(ranks.device),
        Pipeline.start(
            writer,
            device=ranks.device,
            capacity_tokens=cfg.batching.token_budget,
            writer_threads=cfg.run.writer_threads,
            queue_depth=cfg.run.queue_depth,
        ) as pipe,
        RateBar(
            total,
            unit="sample",
            desc=ranks.label("precompute"),
            enabled=cfg.run.progress and ranks.main,
            note=lambda: f"{human_bytes(pipe.stats.bytes_written)} written",
        ) as bar,
    ):
        run_sort_windows(
            target,
            _load_sort_windows(units, sort_windows),
            pipe,
            cfg.batching.token_budget,
            bar.update,
        )
    log.info(
        "%d shards written from %s tokens in %d batches; waited %.1f s for the disk",
        pipe.stats.units_written,
        f"{pipe.stats.tokens:,}",
        pipe.stats.batches,
        pipe.stats.wait_s,
    )
    return pipe.stats, load_s


@contextlib.contextmanager
def _cpu_core_for_writers(device: torch.device) -> Iterator[None]:
    """On a CPU, the forward's thread pool leaves one core to the collector and writer threads: a
    pool spanning every core stalls whenever they run (10x slower forwards, measured on 2 cores)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads < 2:
        yield
        return
    torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------- summary


def make_summary(
    plan: Plan,
    stats: list[PipelineStats],
    timings: dict[str, float],
    previous: dict[str, Any] | None,
    world: int,
) -> dict[str, Any]:
    """The store's summary: totals of the whole input (from the plan) and one entry per run (a
    resumed store keeps the entries of the runs before)."""
    total = lambda field: sum(getattr(s, field) for s in stats)  # noqa: E731
    this_run = {
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": world,
        "units_written": total("units_written"),
        "units_already_in_store": plan.committed_units,
        "units_published_elsewhere": total("units_published_elsewhere"),
        "bytes_written": total("bytes_written"),
        "batches": total("batches"),
        "tokens_forwarded": total("tokens"),
        "padded_tokens": total("padded_tokens"),
        "seconds": {k: round(v, 3) for k, v in timings.items()},
        "tokens_per_s": round(total("tokens") / max(1e-9, timings["forward_write"]), 1),
        "disk_wait_s_max_rank": round(max(s.wait_s for s in stats), 3),
        "gpu_busy_s": round(total("gpu_busy_s"), 3),
        "gpu_idle_s_max_rank": round(max(s.gpu_idle_s for s in stats), 3),
        "write_s": round(total("write_s"), 3),
        "max_units_in_memory": max(s.max_units_in_memory for s in stats),
    }
    runs = list((previous or {}).get("runs", [])) + [this_run]
    return {
        "records": plan.records,
        "units": plan.units,
        "samples": plan.samples,
        "tokens": plan.tokens,
        "response_tokens": plan.response_tokens,
        "truncated": plan.truncated,
        "as_generated": plan.as_generated,
        "ids_unused": plan.ids_unused,
        "earlier_masked": plan.earlier_masked,
        "earlier_apart": plan.earlier_apart,
        "skips": plan.skips.to_dict(),
        "empty_units": plan.empty_units,
        "shards": list(plan.shards),
        "bytes_projected": plan.bytes_total,
        "runs": runs,
    }


def _elsewhere(run: dict[str, Any]) -> str:
    n = run["units_published_elsewhere"]
    return f", {n:,} published meanwhile by another job (its copy kept)" if n else ""


def format_summary(summary: dict[str, Any], disk: int | None = None) -> str:
    """The summary's lines; `disk`, the store's bytes on disk (contents.disk_bytes, the size
    `dflash-store info` prints), once the summary is written."""
    run = summary["runs"][-1]
    skips = ", ".join(f"{k} {v:,}" for k, v in summary["skips"]["counts"].items()) or "none"
    s = run["seconds"]
    return "\n".join(
        [
            f"done: {summary['samples']:,} samples, {summary['tokens']:,} tokens in "
            f"{summary['units']:,} work units ({len(summary['empty_units']):,} without a sequence)",
            f"  skipped records: {skips}; truncated {summary['truncated']:,}",
            f"  this run: {run['units_written']:,} shards written, "
            f"{run['units_already_in_store']:,} already in the store{_elsewhere(run)}; "
            f"{run['tokens_forwarded']:,} tokens forwarded at {run['tokens_per_s']:,.0f} tok/s "
            f"on {run['world_size']} rank(s)",
            f"  time: {s['total']:.1f} s (plan {s['plan']:.1f}, target load "
            f"{s['load_target']:.1f}, staging buffers {s['staging_setup']:.1f}, forward + write "
            f"{s['forward_write']:.1f}); the forward waited for the disk "
            f"{run['disk_wait_s_max_rank']:.1f} s" + _gpu_idle(run),
        ]
        + ([] if disk is None else [_store_line(summary, disk)])
    )


def _store_line(summary: dict[str, Any], disk: int) -> str:
    return (
        f"  store: {len(summary['shards']):,} shards, {human_bytes(disk)} on disk ({disk:,} B, "
        "as dflash-store info counts it)"
    )


def _gpu_idle(run: dict[str, Any]) -> str:
    if not run.get("gpu_busy_s"):
        return ""  # a CPU run (or a store summarised before the GPU clock existed)
    return (
        f"; the GPU computed {run['gpu_busy_s']:.1f} s and stood idle "
        f"{run['gpu_idle_s_max_rank']:.1f} s between batches (for the host, or for the disk when "
        "the forward waited for it)"
    )
