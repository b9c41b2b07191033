"""Validation on held-out sequences: weighted loss, accuracy per block position and the estimated
acceptance length tau, from the same objective the trainer optimises.

The trainer calls `evaluate_offline` every `validation.every_steps`; `dflash-eval` calls it for its
offline estimate with a store path, and then reads the same held-out sequences the trainer held out
(train/plan.py `holdout_split`: fixed by shard names, not by any seed).

    metrics = evaluate_offline(drafter, "stores/qwen3-8b")            # a store: its held-out split
    metrics = evaluate_offline(drafter, device_batches)                # batches already on the device
    metrics["loss"], metrics["acc"], metrics["acc_by_pos"], metrics["tau"]
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from dflash_common.drafter.loss import fused_lm_head_loss
from dflash_common.drafter.objective import IGNORE_INDEX, AcceptanceCounts, block_labels
from dflash_common.drafter.soft_loss import greedy_prompt_labels, soft_kind, soft_lm_head_loss, teacher_rows


def block_counts(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """bool [A, B] -> float64 [2B + 2] on the same device, laid out as `AcceptanceCounts.to_tensor`
    (correct per position, valid per position, accepted drafts, blocks). Stays on the device, so a
    training step never waits for the GPU just to count."""
    hit = (correct & valid)[:, 1:]  # position 0 is the anchor, never a prediction
    accepted = torch.cumprod(hit.long(), dim=1).sum(1)  # leading correct run from k = 1
    has_any = valid[:, 1:].any(1)
    return torch.cat([(correct & valid).sum(0).double(), valid.sum(0).double(),
                      (accepted * has_any).sum().double()[None], has_any.sum().double()[None]])


def batch_objective(drafter: torch.nn.Module, model: torch.nn.Module, batch: Any, *, block_size: int,
                    gamma: float | None, autocast: str, targets: Any = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed batch through `model` (the drafter, or its DDP wrapper) and the fused loss;
    `targets` (train config's TargetsSection) switches on soft targets and prompt-anchor labels.

    Returns (weighted loss sum: float32 scalar with grad, weight sum: float32 scalar, counts [2B+2]).
    """
    device = batch.features.device
    prompt = targets is not None and targets.prompt_anchors
    mask = torch.ones_like(batch.loss_mask) if prompt else batch.loss_mask  # prompt labels count too
    labels, weights = block_labels(batch.input_ids, mask, batch.cu_seqlens, batch.anchors,
                                   block_size, gamma)  # [A, B] each
    if prompt:
        labels = greedy_prompt_labels(labels, batch.loss_mask, batch.anchors)
    enabled = autocast == "bf16"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled):
        hidden = model(batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors)  # [A, B, H]
        if targets is not None and targets.needs_final_state:
            out = soft_lm_head_loss(hidden.flatten(0, 1), drafter.lm_head_weight, labels.flatten(), weights.flatten(),
                                    batch.final, teacher_rows(batch.anchors, block_size).flatten(),
                                    soft_kind(targets.soft), targets.temperature)
        else:
            out = fused_lm_head_loss(hidden.flatten(0, 1), drafter.lm_head_weight, labels.flatten(),
                                     weights.flatten())
    correct = out.correct.view_as(labels)  # [A*B] -> [A, B]
    return out.loss, weights.sum(), block_counts(correct, labels != IGNORE_INDEX)


def summarize(loss_sum: float, weight_sum: float, counts: torch.Tensor) -> dict[str, Any]:
    """Sums -> the reported figures (accuracies by position k = 1..B-1; position 0 is the anchor)."""
    acc = AcceptanceCounts.from_tensor(counts)
    return {
        "loss": loss_sum / weight_sum if weight_sum else math.nan,
        "acc": acc.accuracy,
        "acc_by_pos": [float(x) for x in acc.per_position_accuracy[1:].nan_to_num(0.0)],
        "tau": acc.tau,
        "blocks": int(acc.blocks),
    }


@torch.no_grad()
def evaluate_batches(drafter: torch.nn.Module, batches: Iterable[Any], *, block_size: int,
                     gamma: float | None = None, autocast: str = "bf16", reduce: bool = False,
                     targets: Any = None) -> dict[str, Any]:
    """Loss, accuracy by position and tau over device batches (objects with features, input_ids,
    loss_mask, cu_seqlens, anchors). With `reduce`, sums are all-reduced over the process group."""
    was_training = drafter.training
    drafter.eval()
    device = next(drafter.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, weight, sequences
    counts = torch.zeros(2 * block_size + 2, dtype=torch.float64, device=device)
    for batch in batches:
        if batch.anchors.numel() == 0:
            continue
        loss, weight, c = batch_objective(drafter, drafter, batch, block_size=block_size, gamma=gamma,
                                          autocast=autocast, targets=targets)
        sums += torch.stack([loss.double(), weight.double(), torch.tensor(batch.cu_seqlens.numel() - 1.0,
                                                                          dtype=torch.float64, device=device)])
        counts += c
    if reduce and dist.is_initialized():
        both = torch.cat([sums, counts])
        dist.all_reduce(both)
        sums, counts = both[:3], both[3:]
    drafter.train(was_training)
    out = summarize(float(sums[0]), float(sums[1]), counts.cpu())
    out["sequences"] = int(sums[2])
    return out


def evaluate_offline(
    drafter: torch.nn.Module,
    source: Iterable[Any] | str | Path,
    *,
    gamma: float | None = None,
    max_anchors: int = 512,
    holdout_sequences: int = 256,
    holdout_fraction: float = 0.0,
    batch_tokens: int = 65536,
    reader_threads: int = 4,
    autocast: str = "bf16",
) -> dict[str, Any]:
    """The offline estimate of a drafter (frozen embedding and lm_head attached, on its device).

    `source` is an iterable of device batches, or a store directory: then its held-out sequences
    (the first `holdout_sequences` / `holdout_fraction` by the trainer's rule, with the trainer's
    defaults) are read, packed into `batch_tokens` batches and given fixed anchors.
    Returns {"loss", "acc", "acc_by_pos" (k = 1..B-1), "tau", "blocks", "sequences"}.
    """
    block_size = drafter.cfg.block_size
    if not isinstance(source, (str, Path)):
        return evaluate_batches(drafter, source, block_size=block_size, gamma=gamma, autocast=autocast)
    from train.data import heldout_batches

    with heldout_batches(source, drafter.cfg, device=next(drafter.parameters()).device,
                         max_anchors=max_anchors, holdout_sequences=holdout_sequences,
                         holdout_fraction=holdout_fraction, batch_tokens=batch_tokens,
                         reader_threads=reader_threads, autocast=autocast) as batches:
        return evaluate_batches(drafter, batches, block_size=block_size, gamma=gamma, autocast=autocast)

