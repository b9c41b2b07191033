"""The training loop of `dflash-train`: set up, then one visible loop

    for step in range(start + 1, total + 1):
        fetch batch(es) -> forward, fused loss, backward -> clip, AdamW, lr schedule -> log
            -> checkpoint

Precision: weights, gradients and AdamW state are float32 (the master weights); forward and loss run
under bf16 autocast. Several GPUs: torchrun starts one process per GPU, each with its own shard
cache and its own disjoint shards (train/plan.py), and DDP averages gradients.

Exact resume: weights, optimiser, scheduler, RNG states and the data position are checkpointed at
step boundaries, and anchors are a function of the position, so a stopped-and-resumed run repeats
the losses of an uninterrupted one bit for bit on a CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dflash_common.cli import progress_bar, write_run_record

from dflash_common.dist import Ranks, run_on_ranks
from dflash_common.errors import UserError
from dflash_common.config import ConfigError
from dflash_common.drafter.arch import config_class, new_drafter
from dflash_common.drafter.config import DrafterConfig
from dflash_common.drafter.export import load_weights_into, save_drafter
from dflash_common.drafter.model import DFlashDrafter
from dflash_common.dirlock import hold_directory
from dflash_common.drafter.target_head import load_target_head
from dflash_common.fsutil import check_writable, human_bytes
from dflash_common.store import Store, check_compatible
from dflash_common.store import open_stores
from train.cache import CacheStats
from train.checkpoint import (
    StopRequest,
    latest_checkpoint,
    load_checkpoint,
    remove_stale_saves,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from train.config import TrainConfig
from train.data import BadShards, TrainData
from train.metrics import MetricsWriter
from train.objective import batch_objective
from train.optim import build_optimizer
from train.regularise import WeightAverage, add_feature_noise, noise_generator
from train.report import save_report
from train.resume import checkpoint_to_resume, discard_earlier_run, new_run_hint, resume_record
from train.target import check_same_target, mask_token_id, target_config, tokenizer_sha256
from train.validate import evaluate_batches, summarize_sums

log = logging.getLogger("dflash")


def open_train_stores(cfg: TrainConfig) -> list[Store]:
    if not cfg.data.stores:
        raise UserError(
            "No store given; pass --store PATH (repeatable) or set data.stores in the config."
        )
    return open_stores(cfg.data.stores, read_threads=cfg.data.reader_threads)


def resolve_drafter(cfg: TrainConfig, stores: list[Store]) -> DrafterConfig:
    """The drafter's config, from the target's config and the [drafter] section."""
    shape = cfg.drafter
    layer_ids = shape.layer_ids
    if layer_ids is None:
        layer_ids = list(stores[0].manifest.layer_ids)
    cls = config_class(shape.arch)

    # the arch's own fields that [drafter] sets (its other ones, read from released configs, keep
    # their defaults)
    def names(c) -> set[str]:
        return {f.name for f in dataclasses.fields(c)}

    own = (names(cls) - names(DrafterConfig)) & names(shape)
    try:
        return cls.from_target(
            target_config(cfg.run.target),
            mask_token_id=mask_token_id(cfg.run.target, shape.mask_token_id),
            depth=shape.depth,
            block_size=shape.block_size,
            layer_ids=layer_ids,
            layer_types=shape.layer_types,
            sliding_window=shape.sliding_window,
            **{name: getattr(shape, name) for name in own},
        )
    except ConfigError as e:  # e.g. a group size that does not divide the target's hidden size
        raise UserError(f"[drafter] does not fit the target {cfg.run.target}: {e}") from e


def check_stores(stores: list[Store], dcfg: DrafterConfig, target: str) -> str:
    """Refuse a store this drafter cannot train from; return the one-sentence verdict."""
    sha = tokenizer_sha256(target)
    for store in stores:
        check_compatible(
            store.manifest,
            layer_ids=dcfg.target_layer_ids,
            hidden_size=dcfg.hidden_size,
            tokenizer_sha256=sha,
            where=f"store {store.path}",
        )
        check_same_target(store.manifest, store.path, target)
    held = "; ".join(f"{s.path} holds layers {list(s.manifest.layer_ids)}" for s in stores)
    return (
        f"Compatible: {held}; the drafter reads layers {list(dcfg.target_layer_ids)} at hidden "
        f"size {dcfg.hidden_size}, the target's, and the embedding, lm_head, config and tokenizer "
        f"of {target} (sha256 {sha[:12]}) are the store's."
    )


def build_drafter(cfg: TrainConfig, dcfg: DrafterConfig, device: torch.device) -> DFlashDrafter:
    torch.manual_seed(
        cfg.run.seed
    )  # the same random start on every rank and every run of this seed
    drafter = new_drafter(dcfg)
    if (
        cfg.drafter.init_from
    ):  # refuses a drafter whose config differs in anything that shapes weights
        load_weights_into(drafter, cfg.drafter.init_from)
    drafter.to(device=device, dtype=torch.float32)  # fp32 master weights; autocast computes in bf16
    head_dtype = torch.bfloat16 if cfg.precision.autocast == "bf16" else torch.float32
    head = load_target_head(cfg.run.target, device=device, dtype=head_dtype)
    drafter.attach_frozen(head.embed, head.lm_head)
    if cfg.precision.compile and device.type == "cuda":
        drafter.compile_regions()
    return drafter


def total_steps(cfg: TrainConfig, data: TrainData) -> int:
    if cfg.optim.max_steps is not None:
        return cfg.optim.max_steps
    total = sum(data.plan.steps_in_epoch(e) for e in range(cfg.optim.epochs))
    if total == 0:
        raise UserError(
            "The stores give no full optimiser step per epoch; add data, lower data.batch_tokens "
            "or optim.grad_accum, or use fewer ranks."
        )
    return total


# Layout of the per-step sums kept on the device between logging steps (one all_reduce per log).
_LOSS, _WEIGHT, _CE, _CE_ROWS, _TOKENS, _GNORM, _WAIT, _N = range(8)


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """Where the last micro-batch of a step came from (its tensors are already freed)."""

    epoch: int
    position: dict[str, Any]  # data-pipeline state that resumes right after this step
    lr: float = 0.0  # the learning rate this step used


def train_step(
    model,
    drafter: DFlashDrafter,
    feeder,
    optimizer,
    scheduler,
    cfg: TrainConfig,
    sums: torch.Tensor,
    counts: torch.Tensor,
    ema: WeightAverage | None = None,
) -> StepInfo:
    """One optimiser step over `grad_accum` micro-batches; adds its figures into `sums` and
    `counts`; then the weights' moving average, if kept, takes the new weights in."""
    info, scale = _accumulate(model, drafter, feeder, cfg, sums, counts)
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    lr = optimizer.param_groups[0]["lr"]
    grad_norm = clip_and_step(optimizer, list(drafter.parameters()), clip, scale)
    sums[_GNORM] += grad_norm.double()
    sums[_N] += 1
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        ema.update()
    return dataclasses.replace(info, lr=lr)


def clip_and_step(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    max_norm: float,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The optimiser step on the gradients times `scale` (a 0-dim tensor, None for 1), their global
    L2 norm clipped to `max_norm` first (clip_grad_norm_'s rule: times
    min(1, max_norm / (norm + 1e-6))); returns that norm, of the scaled gradients. The gradients are
    read once for the norm and once by the step: a fused AdamW takes the whole factor as its
    `grad_scale` (the attribute GradScaler sets, which the fused kernel divides every gradient by as
    it reads it), so the two read-and-write passes of 4 bytes a parameter that scaling and clipping
    cost apart are not made. Another optimiser gets the gradients multiplied once."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        optimizer.step()
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads)
    if scale is not None:
        norm = norm * scale.to(norm.dtype)
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if scale is not None:
        factor = factor * scale.to(factor.dtype)
    if optimizer.defaults.get("fused"):
        optimizer.grad_scale = (1.0 / factor).float()
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
    else:
        torch._foreach_mul_(grads, factor.to(grads[0].dtype))
        optimizer.step()
    return norm


def accumulate_gradients(
    model,
    drafter: DFlashDrafter,
    feeder,
    cfg: TrainConfig,
    sums: torch.Tensor,
    counts: torch.Tensor,
) -> StepInfo:
    """Gradients of the step's objective: the weighted CE summed over every micro-batch of every
    rank, divided by their summed normaliser (the weights, or the blocks under objective.normalise =
    anchors); the same gradient as one batch holding them all, whatever `grad_accum` and the number
    of ranks (not a mean of per-batch means, which would weigh a token of a batch with few anchors
    more). Each micro-batch backpropagates its plain sum; the normalisers are summed over ranks (one
    small all_reduce, no host sync) and the gradients scaled once at the end (in a training step, by
    the optimiser step itself: clip_and_step)."""
    info, scale = _accumulate(model, drafter, feeder, cfg, sums, counts)
    grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))
    return info


def _accumulate(
    model,
    drafter: DFlashDrafter,
    feeder,
    cfg: TrainConfig,
    sums: torch.Tensor,
    counts: torch.Tensor,
) -> tuple[StepInfo, torch.Tensor]:
    """accumulate_gradients without the final scaling: (info, the factor the gradients are to
    take)."""
    accum, objective = cfg.optim.grad_accum, cfg.objective
    rank = dist.get_rank() if dist.is_initialized() else 0
    weight_sum = torch.zeros(
        (), dtype=torch.float64, device=sums.device
    )  # this step's, on this rank
    for micro in range(accum):
        batch = next(feeder)
        if batch.anchors.numel() == 0:
            raise RuntimeError(f"batch {batch.index} of epoch {batch.epoch} has no anchors")
        if cfg.regularise.noise > 0:
            gen = noise_generator(
                batch.features.device, cfg.run.seed, batch.epoch, rank, batch.index
            )
            add_feature_noise(batch.features, drafter.cfg.hidden_size, cfg.regularise.noise, gen)
        last = micro == accum - 1
        sync = model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()
        found: dict[str, torch.Tensor] = {}
        with sync:
            loss_sum, weight, batch_counts = batch_objective(
                drafter,
                model,
                batch,
                block_size=drafter.cfg.block_size,
                gamma=objective.gamma,
                autocast=cfg.precision.autocast,
                weights=objective.weights,
                dpace_alpha=objective.dpace_alpha,
                normalise=objective.normalise,
                targets=cfg.targets,
                path_weight=objective.path_weight,
                loss_method=cfg.precision.loss_method,
                objective=objective,
                extras=found,
            )
            loss_sum.backward()
        weight_sum += weight.detach().double()
        sums[_LOSS] += loss_sum.detach().double()
        sums[_WEIGHT] += weight.double()
        sums[_CE : _CE_ROWS + 1] += found["ce"]
        sums[_TOKENS] += batch.tokens
        sums[_WAIT] += batch.data_wait_s
        counts += batch_counts
        info = StepInfo(batch.epoch, batch.position)
        del batch  # free its features before the next batch is decoded: one batch on the GPU
    world = 1
    if dist.is_initialized():
        dist.all_reduce(weight_sum)
        world = (
            dist.get_world_size()
        )  # DDP has averaged the gradients over the ranks: undo the 1/world
    return info, world / weight_sum.clamp(min=1e-9)


class LogInterval:
    """The figures of the steps since the last logging step, kept on the device (no per-step
    sync)."""

    def __init__(self, device: torch.device, block_size: int):
        self.device = device
        self.sums = torch.zeros(_N + 1, dtype=torch.float64, device=device)  # laid out by _LOSS.._N
        self.counts = torch.zeros(
            2 * block_size + 2, dtype=torch.float64, device=device
        )  # block_counts layout
        self.cache_seen = (0, 0, 0)  # cache hits, misses, bytes read at the last logging step
        self.started = time.perf_counter()

    def restart_clock(self) -> None:
        """Leave validation and checkpoint time out of tok/s."""
        self.started = time.perf_counter()

    def record(
        self, step: int, epoch: int, lr: float, cache: CacheStats, world: int, bad: BadShards
    ) -> dict[str, Any]:
        """Sum the interval's figures over ranks (one collective), make the logging step's record,
        start the next interval."""
        now = (cache.hits, cache.misses, cache.bytes_read)
        # ranks read apart: each its own cache counters since the last logging step
        reads = [a - b for a, b in zip(now, self.cache_seen)] + [bad.found_while_reading()]
        reads_t = torch.tensor(reads, dtype=torch.float64, device=self.device)
        both = torch.cat([self.sums, self.counts, reads_t])
        if dist.is_initialized():
            dist.all_reduce(both)
        both = both.cpu()
        sums, counts, (hits, misses, read, bad_read) = (
            both[: _N + 1],
            both[_N + 1 : -4],
            both[-4:].tolist(),
        )
        figures = summarize_sums(float(sums[_LOSS]), float(sums[_WEIGHT]), counts)
        steps = max(1.0, float(sums[_N]))
        record = {
            "kind": "train",
            "step": step,
            "epoch": epoch + 1,  # from 1: the last step of a 4-epoch run is in epoch 4
            "loss": figures["loss"],
            "ce": float(sums[_CE] / sums[_CE_ROWS]) if sums[_CE_ROWS] else math.nan,
            "acc": figures["acc"],
            "acc_by_pos": figures["acc_by_pos"],
            "tau": figures["tau"],
            "lr": lr,
            "grad_norm": float(sums[_GNORM]) / steps,
            "tok_s": float(sums[_TOKENS]) / max(time.perf_counter() - self.started, 1e-9),
            "data_wait_ms": 1e3 * float(sums[_WAIT]) / steps,
            "cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "cache_read_gib": read / 2**30,
            "gpu_mem_gib": self._peak_memory_gib(),
            "steps": steps / world,
            "bad_shards": bad.at_scan + int(bad_read),
            "time": time.time(),
        }
        self.sums.zero_(), self.counts.zero_()
        self.cache_seen, self.started = now, time.perf_counter()
        return record

    def _peak_memory_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak


@dataclasses.dataclass
class Run:
    """What the loop works with, built by `setup`."""

    cfg: TrainConfig
    ranks: Ranks
    out: Path
    drafter: DFlashDrafter
    model: torch.nn.Module  # the drafter, or its DDP wrapper
    data: TrainData
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total: int
    start: int  # optimiser steps already done (resume)
    position: dict[str, Any] | None  # data position to resume from
    ema: WeightAverage | None = None  # the weights' moving average (regularise.ema > 0)


def setup(cfg: TrainConfig, proc: Ranks) -> Run:
    """Everything the loop needs, every check passed before the run directory is written to."""
    out = Path(cfg.run.out_dir)
    stores = open_train_stores(cfg)
    dcfg = resolve_drafter(cfg, stores)
    verdict = check_stores(stores, dcfg, cfg.run.target)
    from_path, changed = checkpoint_to_resume(cfg, out, dcfg)
    if proc.main:
        log.info("%s", verdict)
    drafter = build_drafter(cfg, dcfg, proc.device)
    data = TrainData.build(
        cfg,
        stores,
        dcfg.target_layer_ids,
        rank=proc.rank,
        world=proc.world,
        device=proc.device,
        block_size=dcfg.verify_block_size,
    )
    total = total_steps(cfg, data)
    optimizer, scheduler = build_optimizer(cfg.optim, drafter, total, proc.device)
    ema = WeightAverage(drafter, cfg.regularise.ema) if cfg.regularise.ema > 0 else None
    start, position = resume(
        from_path, proc, drafter, optimizer, scheduler, ema, total=total, out=out
    )
    if proc.main:
        if changed:
            log.warning(
                "resuming from %s with new values of settings that do not change what is "
                "trained (recorded in run.json): %s",
                from_path,
                ", ".join(f"{k} ({old!r} -> {new!r})" for k, (old, new) in changed.items()),
            )
        out.mkdir(parents=True, exist_ok=True)
        remove_stale_saves(out)
        if not cfg.checkpoint.resume:
            discard_earlier_run(out)
        write_run_record(out, cfg, name="run", extra=resume_record(out, from_path, changed))
    model = drafter
    if proc.world > 1:
        model = DDP(
            drafter,
            device_ids=[proc.device.index] if proc.device.type == "cuda" else None,
            broadcast_buffers=False,
        )  # no buffers; the frozen head is a plain attribute
    return Run(
        cfg, proc, out, drafter, model, data, optimizer, scheduler, total, start, position, ema
    )


def resume(
    path: Path | None,
    proc: Ranks,
    drafter,
    optimizer,
    scheduler,
    ema: WeightAverage | None = None,
    *,
    total: int | None = None,
    out: Path | None = None,
) -> tuple[int, dict | None]:
    """Load checkpoint `path` (see checkpoint_to_resume), if any: (steps done, data position). An
    EMA missing from the checkpoint (it was written without regularise.ema) restarts from its
    weights. A schedule of another length than `total` (the stores' shards changed since) is
    refused."""
    if path is None:
        return 0, None
    trainer_state, ranks = load_checkpoint(path)
    if len(ranks) != proc.world:
        raise UserError(
            f"{path} was written by {len(ranks)} rank(s) but this run has {proc.world}; resume "
            f"with {len(ranks)}, or start a new run directory (--out)."
        )
    scheduled = trainer_state.get("total_steps")
    if total is not None and scheduled is not None and scheduled != total:
        raise UserError(
            f"cannot resume from {path}: its learning-rate schedule spans {scheduled} "
            f"optimiser steps, but the stores now give {total} with its settings "
            f"(their shards changed since); resume with the stores it trained on, or "
            f"{new_run_hint(out or path.parent)}."
        )
    load_weights_into(drafter, path / "drafter")
    optimizer.load_state_dict(trainer_state["optimizer"])
    scheduler.load_state_dict(trainer_state["scheduler"])
    _resume_average(path, trainer_state.get("trained_weights"), drafter, ema)
    set_rng_state(ranks[proc.rank]["rng"])
    if proc.main:
        log.info("resuming from %s (step %d)", path, trainer_state["step"])
    return int(trainer_state["step"]), ranks[proc.rank]["data"]


def _resume_average(
    path: Path, trained: dict[str, torch.Tensor] | None, drafter, ema: WeightAverage | None
) -> None:
    """A checkpoint written with an EMA holds the average in drafter/ (just loaded) and the trained
    weights in trainer.pt: the average becomes the EMA's shadow, the trained weights the
    drafter's."""
    if ema is not None:
        if trained is None:
            log.warning(
                "%s holds no weight average (regularise.ema was 0); the average starts from its "
                "weights",
                path,
            )
        ema.shadow = [p.detach().float().clone() for p in ema.params]
    if trained is not None:
        if ema is None:
            log.warning(
                "%s was written with regularise.ema; training goes on from its trained weights, "
                "without the average",
                path,
            )
        drafter.load_state_dict(trained)  # parameters only: the frozen head is a plain attribute


def checkpoint(r: Run, step: int, position: dict[str, Any]) -> Path:
    """Save step-N/ (rank 0 writes; every rank contributes its data position and RNG states)."""
    ranks = r.ranks.gather({"data": position, "rng": rng_state()})
    path = Path(r.out) / f"step-{step}"
    if r.ranks.main:
        trainer_state = {
            "step": step,
            "optimizer": r.optimizer.state_dict(),
            "scheduler": r.scheduler.state_dict(),
            "total_steps": r.total,
        }
        if (
            r.ema is not None
        ):  # drafter/ holds the average (what validation measured and export takes)
            trainer_state["trained_weights"] = {
                n: p.detach().cpu().clone() for n, p in r.drafter.named_parameters()
            }
        with r.ema.swapped_in() if r.ema is not None else contextlib.nullcontext():
            path = save_checkpoint(
                r.out,
                step,
                save_drafter=lambda d: save_drafter(r.drafter, d, dtype=torch.float32),
                trainer_state=trainer_state,
                rank_states=ranks,
                cfg=r.cfg,
                keep_last=r.cfg.checkpoint.keep_last,
            )
        save_report(r.out)
    r.ranks.barrier()
    return path


def validate(r: Run, step: int, metrics: MetricsWriter | None) -> dict[str, Any] | None:
    if r.data.val_cache is None:
        return None
    with (
        r.ema.swapped_in() if r.ema is not None else contextlib.nullcontext()
    ):  # validate what is exported
        result = evaluate_batches(
            r.drafter,
            r.data.val_batches(),
            block_size=r.drafter.cfg.verify_block_size,
            gamma=r.cfg.objective.gamma,
            autocast=r.cfg.precision.autocast,
            reduce=True,
            targets=dataclasses.replace(r.cfg.targets, prompt_anchors=False),
        )  # response anchors
    record = {"kind": "val", "step": step, **result}
    if metrics is not None:
        metrics.write(record)
    return record


def run(cfg: TrainConfig) -> Path:
    """Train a drafter as `cfg` says; returns the run directory (final drafter in
    RUN_DIR/drafter)."""
    check_writable(cfg.run.out_dir, "run.out_dir", "pass --out a directory on a writable disk")

    def full(why: str) -> str:  # a full disk anywhere (metrics, report, checkpoint): how to go on
        latest = latest_checkpoint(cfg.run.out_dir)
        return (
            f"no space left on the filesystem of {cfg.run.out_dir} ({why}); free space (or lower "
            f"checkpoint.keep_last) and rerun the same command: it resumes from "
            f"{latest or 'the start'}."
        )

    with run_on_ranks(cfg.run.device, full_disk=full) as ranks, _own_run_directory(cfg, ranks):
        return _run(cfg, ranks)


def _own_run_directory(cfg: TrainConfig, ranks: Ranks) -> contextlib.AbstractContextManager:
    """Rank 0 holds the run directory for the whole run: a second dflash-train into it is refused
    before it reads a checkpoint (the other ranks of this job share rank 0's hold). A run refused
    before it wrote anything leaves no lock file, nor a directory it made."""
    if not ranks.main:
        return contextlib.nullcontext()
    fix = "wait for that run to end (or stop it), or train into another directory (--out)"
    return hold_directory(cfg.run.out_dir, "run directory", fix, tidy=True)


def _run(cfg: TrainConfig, ranks: Ranks) -> Path:
    r = setup(cfg, ranks)
    metrics = None
    if r.ranks.main:
        epochs = r.cfg.optim.epochs if r.cfg.optim.max_steps is None else None  # else steps rule
        metrics = MetricsWriter(
            r.out,
            r.total,
            r.cfg.log.tensorboard,
            r.start,
            epochs=epochs,
            every_steps=r.cfg.log.every_steps,
        )
    try:
        saved, stopped = train(r, metrics)
    except (
        BaseException
    ):  # e.g. a corrupt shard under data.on_bad_shard = stop: what is saved stays
        r.data.close()  # stop the loader and reader threads, so the process can end
        if metrics is not None:
            metrics.close()
        raise
    return finish(r, metrics, saved, stopped)


def train(r: Run, metrics: MetricsWriter | None) -> tuple[int, int | None]:
    """The loop: -> (last step saved, the signal that stopped it early or None)."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    cfg, main = r.cfg, r.ranks.main
    interval = LogInterval(r.ranks.device, r.drafter.cfg.verify_block_size)
    feeder = r.data.start(r.position)
    saved, stopped = r.start, None
    bar = progress_bar(
        total=r.total,
        initial=r.start,
        enabled=main and cfg.log.progress,
        unit="step",
        dynamic_ncols=True,
    )
    with StopRequest() as stop, logging_redirect_tqdm():
        for step in range(r.start + 1, r.total + 1):
            info = train_step(
                r.model,
                r.drafter,
                feeder,
                r.optimizer,
                r.scheduler,
                cfg,
                interval.sums,
                interval.counts,
                r.ema,
            )
            bar.update(1)
            last = step == r.total
            if step % cfg.log.every_steps == 0 or last:
                record = interval.record(
                    step, info.epoch, info.lr, r.data.cache.stats, r.ranks.world, r.data.bad
                )
                if metrics is not None:
                    metrics.write(record)
            if (cfg.validation.every_steps and step % cfg.validation.every_steps == 0) or last:
                validate(r, step, metrics)
                interval.restart_clock()
            # ranks agree only at log steps
            if r.ranks.world == 1 or step % cfg.log.every_steps == 0 or last:
                stopped = stop.signum if r.ranks.any(stop.requested) else None
            if step % cfg.checkpoint.every_steps == 0 or last or stopped:
                checkpoint(r, step, info.position)
                saved = step
                interval.restart_clock()
            if stopped:
                break
    bar.close()
    return saved, stopped


def finish(r: Run, metrics: MetricsWriter | None, saved: int, stopped: int | None) -> Path:
    st = r.data.cache.stats
    log.info(
        "shard cache: %d hits, %d misses (%.0f%% hits), %s read by the readers in %.1f s, batches "
        "waited %.1f s for shards",
        st.hits,
        st.misses,
        100 * st.hit_rate,
        human_bytes(st.bytes_read),
        st.read_s,
        st.wait_s,
    )
    if r.data.bad.skipped:
        log.warning(
            "%d corrupt shard(s) skipped (data.on_bad_shard = skip): %s; delete them and rerun "
            "dflash-precompute to rewrite them",
            len(r.data.bad.skipped),
            ", ".join(name for _, name in sorted(r.data.bad.skipped)),
        )
    r.data.close()
    if metrics is not None:
        metrics.close()
    if r.ranks.main:
        ckpt = r.out / f"step-{saved}"
        if stopped:
            log.info(
                "stopped by %s after step %d; checkpoint saved in %s; run the same command again "
                "to resume",
                signal.Signals(stopped).name,
                saved,
                ckpt,
            )
        else:
            with (
                r.ema.swapped_in() if r.ema is not None else contextlib.nullcontext()
            ):  # the average, if kept
                save_drafter(
                    r.drafter, r.out / "drafter", dtype=torch.bfloat16, overwrite=True
                )  # as served
            save_report(r.out)
            log.info(
                "done: %d steps; drafter in %s, checkpoint in %s, report %s",
                saved,
                r.out / "drafter",
                ckpt,
                r.out / "report.png",
            )
    return r.out
