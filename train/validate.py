"""Validation on held-out sequences: weighted loss, accuracy per block position and the estimated
acceptance length tau, from the same objective the trainer optimises (train/objective.py).

The trainer calls `evaluate_batches` every `validation.every_steps` on its held-out split;
`dflash-eval --offline` calls it on the same held-out sequences of a store (train/eval/offline.py).

    metrics = evaluate_batches(drafter, device_batches, block_size=B)
    metrics["loss"], metrics["acc"], metrics["acc_by_pos"], metrics["tau"], metrics["path_tau"]

`ce` is the CE of every labelled block position alike, as the trainer's records report it beside
their objective's loss: the two compare (train/objective.py unweighted_ce).

A DFlash2 drafter's acc and tau are those of the path its selector walks (what is served); beside
them `acc_unary` / `tau_unary` (each position's argmax, as DFlash serves), `top_k_recall` (labels
among the selector's candidates) and `selector_loss` (its weighted CE per unit weight).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist

from dflash_common.drafter.model import DFlashDrafter
from dflash_common.drafter.objective import AcceptanceCounts
from train.config import ObjectiveSection, SoftTargetsSection
from train.objective import batch_objective
from train.path_tau import path_counts, replay_batch, summarize_path
from train.transfer import DeviceBatch


def summarize_sums(loss_sum: float, weight_sum: float, counts: torch.Tensor) -> dict[str, Any]:
    """Sums -> the reported figures (accuracies by position k = 1..B-1; position 0 is the
    anchor)."""
    acc = AcceptanceCounts.from_tensor(counts)
    return {
        "loss": loss_sum / weight_sum if weight_sum else math.nan,
        "acc": acc.accuracy,
        "acc_by_pos": [float(x) for x in acc.per_position_accuracy[1:].nan_to_num(0.0)],
        "tau": acc.tau,
        "blocks": int(acc.blocks),
    }


@torch.no_grad()
def evaluate_batches(
    drafter: DFlashDrafter,
    batches: Iterable[DeviceBatch],
    *,
    block_size: int,
    gamma: float | None = None,
    autocast: str = "bf16",
    reduce: bool = False,
    path: bool = True,
    targets: SoftTargetsSection | None = None,
) -> dict[str, Any]:
    """Loss, accuracy by position and tau over device batches; with `path`, also the path tau of
    greedy decoding replayed from the batches (train/path_tau.py: exact when the responses are the
    target's greedy output). With `reduce`, sums are all-reduced over the process group."""
    was_training = drafter.training
    drafter.eval()
    device = next(drafter.parameters()).device
    # loss, weight, sequences, CE sum, CE rows
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    counts = torch.zeros(2 * block_size + 2, dtype=torch.float64, device=device)
    paths = torch.zeros(5, dtype=torch.float64, device=device)  # train/path_tau.py path_counts
    dflash2 = drafter.cfg.arch == "dflash2"
    extra = torch.zeros(2 * block_size + 5 if dflash2 else 0, dtype=torch.float64, device=device)
    for batch in batches:
        if batch.anchors.numel() == 0:
            continue
        found: dict[str, torch.Tensor] = {}
        loss, weight, batch_counts = batch_objective(
            drafter,
            drafter,
            batch,
            block_size=block_size,
            gamma=gamma,
            autocast=autocast,
            targets=targets,
            extras=found,
            objective=ObjectiveSection(selector_weight=0.0),
        )  # the loss stays DFlash's
        if dflash2:
            extra += torch.cat([found["unary"], found["selector"]])
        sums += torch.stack(
            [
                loss.double(),
                weight.double(),
                torch.tensor(batch.cu_seqlens.numel() - 1.0, dtype=torch.float64, device=device),
                *found["ce"],
            ]
        )
        counts += batch_counts
        if path:
            paths += path_counts(replay_batch(drafter, batch, autocast=autocast)).to(device)
    if reduce and dist.is_initialized():
        both = torch.cat([sums, counts, paths, extra])
        dist.all_reduce(both)
        n = counts.numel()
        sums, counts, paths, extra = both[:5], both[5 : 5 + n], both[5 + n : 10 + n], both[10 + n :]
    drafter.train(was_training)
    out = summarize_sums(float(sums[0]), float(sums[1]), counts.cpu())
    out["sequences"] = int(sums[2])
    out["ce"] = float(sums[3] / sums[4]) if sums[4] else math.nan
    if dflash2:
        out.update(_dflash2_figures(extra.cpu(), float(sums[1])))
    if path:
        out.update(summarize_path(paths))
    return out


def _dflash2_figures(extra: torch.Tensor, weight_sum: float) -> dict[str, Any]:
    """DFlash2's diagnostics from the summed extras: [unary counts (2B+2), selector CE, labels
    among the candidates, prediction rows]."""
    unary = AcceptanceCounts.from_tensor(extra[:-3])
    selector_sum, in_top_k, rows = extra[-3:].tolist()
    return {
        "acc_unary": unary.accuracy,
        "tau_unary": unary.tau,
        "top_k_recall": in_top_k / rows if rows else math.nan,
        "selector_loss": selector_sum / weight_sum if weight_sum else math.nan,
    }
