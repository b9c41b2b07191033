"""`dflash-eval --offline`: tau estimated from a store's held-out sequences, without running the
target.

    dflash-eval --offline --store PATH --drafter DIR --target.path=DIR

It reads the same held-out sequences the trainer held out (train/plan.py `holdout_split`: fixed by
shard names, not by any seed) and scores them with the trainer's own validation (train/validate.py
`evaluate_batches`), and replays greedy decoding on them for the path tau (train/path_tau.py).

    metrics = evaluate_offline(drafter, "stores/qwen3-8b")  # a store: its held-out split
    metrics = evaluate_offline(drafter, device_batches)  # batches already on the device
    metrics["loss"], metrics["acc"], metrics["acc_by_pos"], metrics["tau"]
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterable

import torch

from dflash_common.drafter.model import DFlashDrafter
from dflash_common.dist import resolve_device
from dflash_common.config import ConfigError
from dflash_common.errors import UserError
from dflash_common.hf import check_model_dir, load_text_config
from dflash_common.store import Store
from train.cache import ShardCache, SlotSlab
from train.config import load_run_config
from train.data import (
    check_contents,
    make_feeder,
    scan_stores,
    shard_reader,
    slot_size,
    val_batches,
)
from train.eval.config import EvalConfig
from train.eval.load import load_dflash
from train.eval.report import format_offline, write_report
from train.path_tau import path_counts, replay_batch, response_segments, summarize_path
from train.plan import DataPlan, holdout_split
from train.transfer import DeviceBatch
from train.validate import evaluate_batches

log = logging.getLogger("dflash")

# What the offline estimate takes from the training run's run.toml: its held-out split, and how its
# validation packed and weighted the blocks, so the estimate repeats the trainer's own validation.
_RUN_SETTINGS = {
    "holdout_sequences": ("data", "holdout_sequences"),
    "holdout_fraction": ("data", "holdout_fraction"),
    "holdout_by": ("data", "holdout_by"),
    "batch_tokens": ("data", "batch_tokens"),
    "max_anchors": ("objective", "max_anchors"),
    "gamma": ("objective", "gamma"),
}


def _training_run_settings(drafter_path: str) -> dict:
    """Settings of the training run behind `drafter_path` (its run.toml, in a run or step-N
    directory or beside a run's drafter/, read by the config loader), by the keyword names of
    `evaluate_offline`; {} when there is none."""
    here = Path(drafter_path)
    for candidate in (here / "run.toml", here.parent / "run.toml"):
        if candidate.is_file():
            try:
                run = load_run_config(candidate)
            except ConfigError as e:
                log.warning(
                    "%s does not load (%s): the trainer's defaults stand for its "
                    "held-out split and validation; set offline.holdout_sequences if the "
                    "run held out others",
                    candidate,
                    e,
                )
                return {}
            values = {
                key: getattr(getattr(run, sec), name) for key, (sec, name) in _RUN_SETTINGS.items()
            }
            return {key: value for key, value in values.items() if value is not None}
    return {}


def run_offline(cfg: EvalConfig) -> dict:
    """The offline estimate: per-position accuracy and the tau it implies on a store's held-out
    sequences, by the trainer's own validation (train/validate.py), and the path tau: greedy
    decoding replayed from the stored responses with generation.block_size and
    generation.max_new_tokens (train/path_tau.py; what dflash-eval measures when the responses are
    the target's greedy output). The target never runs; only its embedding and lm_head are read from
    target.path."""
    from dflash_common.drafter.target_head import load_target_head

    if not cfg.offline.store:
        raise UserError(
            "--offline needs a store: pass --store PATH (a store written by dflash-precompute)."
        )
    check_model_dir(cfg.target.path)
    device = resolve_device(cfg.target.device, "target.device")
    bf16 = cfg.target.dtype == "bfloat16"  # the trainer's precision: fp32 weights, bf16 autocast
    text_config = load_text_config(cfg.target.path)
    drafter = load_dflash(cfg.drafter.path, text_config, device, torch.float32)
    head = load_target_head(
        cfg.target.path, device=device, dtype=torch.bfloat16 if bf16 else torch.float32
    )
    drafter.attach_frozen(head.embed, head.lm_head)
    settings = _training_run_settings(cfg.drafter.path)
    for key in ("holdout_sequences", "holdout_fraction"):
        if getattr(cfg.offline, key) is not None:
            settings[key] = getattr(cfg.offline, key)
    autocast = "bf16" if bf16 else "none"
    metrics = evaluate_offline(
        drafter, cfg.offline.store, autocast=autocast, path=False, **settings
    )
    split = {
        k: settings[k]
        for k in ("holdout_sequences", "holdout_fraction", "holdout_by", "batch_tokens")
        if k in settings
    }
    path = path_tau_offline(
        drafter,
        cfg.offline.store,
        block_size=cfg.generation.block_size,
        max_new_tokens=cfg.generation.max_new_tokens,
        autocast=autocast,
        **split,
    )
    path.pop("path_prompt_tails")
    report = {
        "mode": "offline",
        "store": cfg.offline.store,
        "drafter": cfg.drafter.path,
        "block_size": drafter.cfg.block_size,
        **settings,
        **metrics,
        **path,
        "path_max_new_tokens": cfg.generation.max_new_tokens,
        "path_block_size": cfg.generation.block_size or drafter.cfg.block_size,
    }
    if cfg.report.path:
        write_report(report, cfg.report.path, cfg)
    print(format_offline(report))
    return report


# ---------------------------------------------------------------- the store's held-out sequences


@torch.no_grad()
def path_tau_batches(
    drafter: DFlashDrafter,
    batches: Iterable[DeviceBatch],
    *,
    block_size: int | None = None,
    max_new_tokens: int | None = None,
    autocast: str = "none",
) -> dict[str, Any]:
    """Path tau alone (train/path_tau.py) over device batches, as dflash-eval would decode their
    responses with `block_size` and `max_new_tokens`; also each response's cycle lengths
    ("path_lengths", in batch order) and its prompt's last token ids ("path_prompt_tails"), to match
    responses to prompts."""
    paths, lengths, tails = torch.zeros(5, dtype=torch.float64), [], []
    for batch in batches:
        got = replay_batch(
            drafter, batch, block_size=block_size, max_new_tokens=max_new_tokens, autocast=autocast
        )
        paths += path_counts(got)
        lengths += got
        tails += _prompt_tails(batch)
    return {**summarize_path(paths), "path_lengths": lengths, "path_prompt_tails": tails}


def _prompt_tails(batch: DeviceBatch, n: int = 16) -> list[list[int]]:
    """The last `n` token ids before each response of a batch (in the order of
    response_segments)."""
    first, _, seq_start = response_segments(batch.loss_mask, batch.cu_seqlens, None)
    ids = batch.input_ids.tolist()
    return [ids[max(s, f - n) : f] for f, s in zip(first.tolist(), seq_start.tolist())]


def evaluate_offline(
    drafter: DFlashDrafter,
    source: Iterable[DeviceBatch] | str | Path,
    *,
    gamma: float | None = None,
    max_anchors: int = 512,
    holdout_sequences: int = 256,
    holdout_fraction: float = 0.0,
    holdout_by: str = "unit",
    batch_tokens: int = 65536,
    reader_threads: int = 4,
    autocast: str = "bf16",
    path: bool = True,
) -> dict[str, Any]:
    """The offline estimate of a drafter (frozen embedding and lm_head attached, on its device).

    `source` is an iterable of device batches, or a store directory: then its held-out sequences
    (the first `holdout_sequences` / `holdout_fraction` by the trainer's rule, with the trainer's
    defaults) are read, packed into `batch_tokens` batches and given fixed anchors.
    Returns {"loss", "acc", "acc_by_pos" (k = 1..B-1), "tau", "blocks", "sequences"} and, with
    `path`, the path tau of those sequences (see `evaluate_batches`).
    """
    block_size = drafter.cfg.verify_block_size  # [anchor, drafts]: DSpark's labels reach further
    if not isinstance(source, (str, Path)):
        return evaluate_batches(
            drafter, source, block_size=block_size, gamma=gamma, autocast=autocast, path=path
        )
    with heldout_batches(
        source,
        drafter.cfg,
        device=next(drafter.parameters()).device,
        max_anchors=max_anchors,
        holdout_sequences=holdout_sequences,
        holdout_fraction=holdout_fraction,
        holdout_by=holdout_by,
        batch_tokens=batch_tokens,
        reader_threads=reader_threads,
        autocast=autocast,
    ) as batches:
        return evaluate_batches(
            drafter, batches, block_size=block_size, gamma=gamma, autocast=autocast, path=path
        )


def path_tau_offline(
    drafter: torch.nn.Module,
    store: str | Path,
    *,
    block_size: int | None = None,
    max_new_tokens: int | None = None,
    holdout_sequences: int = 256,
    holdout_fraction: float = 0.0,
    holdout_by: str = "unit",
    batch_tokens: int = 65536,
    reader_threads: int = 4,
    autocast: str = "none",
) -> dict[str, Any]:
    """Path tau of a store's held-out responses as dflash-eval would decode them (`block_size`,
    `max_new_tokens`): every held-out sequence with at least 2 response tokens (one cycle), not only
    those with 2B that training keeps, so it covers the prompts dflash-eval decodes."""
    with heldout_batches(
        store,
        drafter.cfg,
        device=next(drafter.parameters()).device,
        max_anchors=1,
        holdout_sequences=holdout_sequences,
        holdout_fraction=holdout_fraction,
        holdout_by=holdout_by,
        batch_tokens=batch_tokens,
        reader_threads=reader_threads,
        autocast=autocast,
        min_response=2,
    ) as batches:
        return path_tau_batches(
            drafter,
            batches,
            block_size=block_size,
            max_new_tokens=max_new_tokens,
            autocast=autocast,
        )


@contextlib.contextmanager
def heldout_batches(
    store_path,
    drafter_cfg,
    *,
    device: torch.device,
    max_anchors: int,
    holdout_sequences: int,
    holdout_fraction: float,
    batch_tokens: int,
    reader_threads: int,
    autocast: str,
    min_response: int | None = None,
    holdout_by: str = "unit",
):
    """Device batches of a store's held-out sequences, split as the trainer splits them (it drops
    sequences with fewer than `min_response` response tokens, 2B by default, as training does)."""
    store = Store.open(store_path, read_threads=reader_threads)
    layer_ids = list(drafter_cfg.target_layer_ids)
    check_contents([store])  # a shard missing from the store stops it, as it stops training
    shards = scan_stores([store], reader_threads, batch_tokens)
    min_response = 2 * drafter_cfg.verify_block_size if min_response is None else min_response
    split = holdout_split(shards, 1, holdout_sequences, holdout_fraction, min_response, holdout_by)
    plan = DataPlan(
        shards,
        split,
        n_stores=1,
        weights=None,
        seed=0,
        batch_tokens=batch_tokens,
        shuffle_window_shards=1,
        world=1,
        grad_accum=1,
    )
    nbytes, _ = slot_size([store], shards, layer_ids)
    cache = ShardCache(
        SlotSlab.allocate(2, nbytes), 1, shard_reader([store], shards, layer_ids), threads=1
    )
    host = val_batches(
        plan, cache, rank=0, block_size=drafter_cfg.verify_block_size, max_anchors=max_anchors
    )
    feeder = make_feeder(
        host,
        dict,
        [store],
        layer_ids,
        device=device,
        batch_tokens=batch_tokens,
        autocast=autocast,
        prefetch=0,
    )
    try:
        yield feeder
    finally:
        feeder.close()
        cache.close()
        cache.slab.close()
        store.close()
