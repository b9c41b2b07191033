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

from dflash_common.drafter.loss import (
    fused_lm_head_loss, greedy_prompt_labels, soft_kind, soft_lm_head_loss, teacher_rows,
)
from dflash_common.drafter.objective import (
    IGNORE_INDEX, AcceptanceCounts, accepted_drafts, block_labels, dpace_weights, serving_path,
)
from train.path_tau import path_counts, replay_batch, response_segments, summarize_path


def block_counts(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """bool [A, B] -> float64 [2B + 2] on the same device, laid out as `AcceptanceCounts.to_tensor`
    (correct per position, valid per position, accepted drafts, blocks). Stays on the device, so a
    training step never waits for the GPU just to count."""
    accepted = accepted_drafts(correct, valid)
    has_any = valid[:, 1:].any(1)
    return torch.cat([(correct & valid).sum(0).double(), valid.sum(0).double(),
                      (accepted * has_any).sum().double()[None], has_any.sum().double()[None]])


def batch_objective(drafter: torch.nn.Module, model: torch.nn.Module, batch: Any, *, block_size: int,
                    gamma: float | None, autocast: str, weights: str = "gamma", dpace_alpha: float = 0.5,
                    normalise: str = "weight", targets: Any = None, path_weight: float = 0.0,
                    loss_method: str = "exact") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed batch through `model` (the drafter, or its DDP wrapper) and the fused loss.

    `weights` 'gamma' or 'dpace', `normalise` 'weight' or 'anchors' and `path_weight` as in
    train/config.py's [objective]; D-PACE weights and the serving path come from the same forward's
    per-row CE and correctness (no second pass). `targets` (train config's TargetsSection) switches on
    soft targets and prompt-anchor labels (the config refuses them with path_weight); with them,
    D-PACE's confidence is the drafter's probability of the label (the stored token, or the target's
    greedy token on a prompt position) while the rows it weighs are the soft kind's loss. `loss_method`:
    the hard loss's method (precision.loss_method; fused_lm_head_loss runs 'odds_epilogue' as 'odds' on a CPU).
    Returns (weighted loss sum: float32 scalar with grad, its normaliser: the weight sum or the number
    of blocks with a valid label, those on the serving path counted 1 + path_weight times, float32
    scalar, counts [2B+2]).
    """
    device = batch.features.device
    prompt = targets is not None and targets.prompt_anchors
    mask = torch.ones_like(batch.loss_mask) if prompt else batch.loss_mask  # prompt labels count too
    labels, w = block_labels(batch.input_ids, mask, batch.cu_seqlens, batch.anchors,
                             block_size, gamma)  # [A, B] each
    if prompt:
        labels = greedy_prompt_labels(labels, batch.loss_mask, batch.anchors)
    valid = labels != IGNORE_INDEX
    enabled = autocast == "bf16"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled):
        hidden = model(batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors)  # [A, B, H]
        row_w = valid.float() if weights == "dpace" else w  # D-PACE: unit weights, reweighted below
        if targets is not None and targets.needs_final_state:
            out = soft_lm_head_loss(hidden.flatten(0, 1), drafter.lm_head_weight, labels.flatten(), row_w.flatten(),
                                    batch.final, teacher_rows(batch.anchors, block_size).flatten(),
                                    soft_kind(targets.soft), targets.temperature)
        else:
            out = fused_lm_head_loss(hidden.flatten(0, 1), drafter.lm_head_weight, labels.flatten(), row_w.flatten(),
                                     method=loss_method)
    correct = out.correct.view_as(labels)  # [A*B] -> [A, B]
    row_scale = None  # what multiplies out.rows (per-row CE, gamma-weighted under 'gamma'); None: out.loss
    if weights == "dpace":  # from the drafter's CE to the label (the soft loss's rows are another kind)
        ce = out.rows if out.ce is None else out.ce
        w = dpace_weights(ce.detach().view_as(labels), valid, dpace_alpha)
        row_scale = w
    block_w = None
    if path_weight:  # 0 leaves the objective as it was, bit for bit
        on_path = serving_path(batch.anchors, accepted_drafts(correct, valid), batch.loss_mask, batch.cu_seqlens)
        block_w = 1.0 + path_weight * on_path.float()  # [A], detached: from argmax correctness
        w = w * block_w[:, None]
        row_scale = w if weights == "dpace" else block_w[:, None].expand_as(w)
    loss = out.loss if row_scale is None else (row_scale.flatten() * out.rows).sum()
    has_label = valid[:, 1:].any(1).float()  # [A]
    blocks = has_label if block_w is None else has_label * block_w  # a block on the path counts 1 + path_weight
    norm = blocks.sum() if normalise == "anchors" else w.sum()
    return loss, norm, block_counts(correct, valid)


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
                     path: bool = True, targets: Any = None) -> dict[str, Any]:
    """Loss, accuracy by position and tau over device batches (objects with features, input_ids,
    loss_mask, cu_seqlens, anchors); with `path`, also the path tau of greedy decoding replayed from
    the batches (train/path_tau.py: exact when the responses are the target's greedy output). With
    `reduce`, sums are all-reduced over the process group."""
    was_training = drafter.training
    drafter.eval()
    device = next(drafter.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, weight, sequences
    counts = torch.zeros(2 * block_size + 2, dtype=torch.float64, device=device)
    paths = torch.zeros(5, dtype=torch.float64, device=device)  # train/path_tau.py path_counts
    for batch in batches:
        if batch.anchors.numel() == 0:
            continue
        loss, weight, c = batch_objective(drafter, drafter, batch, block_size=block_size, gamma=gamma,
                                          autocast=autocast, targets=targets)
        sums += torch.stack([loss.double(), weight.double(), torch.tensor(batch.cu_seqlens.numel() - 1.0,
                                                                          dtype=torch.float64, device=device)])
        counts += c
        if path:
            paths += path_counts(replay_batch(drafter, batch, autocast=autocast)).to(device)
    if reduce and dist.is_initialized():
        both = torch.cat([sums, counts, paths])
        dist.all_reduce(both)
        sums, counts, paths = both[:3], both[3:-5], both[-5:]
    drafter.train(was_training)
    out = summarize(float(sums[0]), float(sums[1]), counts.cpu())
    out["sequences"] = int(sums[2])
    if path:
        out.update(summarize_path(paths))
    return out


@torch.no_grad()
def path_tau_batches(drafter: torch.nn.Module, batches: Iterable[Any], *, block_size: int | None = None,
                     max_new_tokens: int | None = None, autocast: str = "none") -> dict[str, Any]:
    """Path tau alone (train/path_tau.py) over device batches, as dflash-eval would decode their
    responses with `block_size` and `max_new_tokens`; also each response's cycle lengths ("path_lengths",
    in batch order) and its prompt's last token ids ("path_prompt_tails"), to match responses to prompts."""
    paths, lengths, tails = torch.zeros(5, dtype=torch.float64), [], []
    for batch in batches:
        got = replay_batch(drafter, batch, block_size=block_size, max_new_tokens=max_new_tokens, autocast=autocast)
        paths += path_counts(got)
        lengths += got
        tails += _prompt_tails(batch)
    return {**summarize_path(paths), "path_lengths": lengths, "path_prompt_tails": tails}


def _prompt_tails(batch: Any, n: int = 16) -> list[list[int]]:
    """The last `n` token ids before each response of a batch (in the order of response_segments)."""
    first, _, seq_start = response_segments(batch.loss_mask, batch.cu_seqlens, None)
    ids = batch.input_ids.tolist()
    return [ids[max(s, f - n):f] for f, s in zip(first.tolist(), seq_start.tolist())]


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
    path: bool = True,
) -> dict[str, Any]:
    """The offline estimate of a drafter (frozen embedding and lm_head attached, on its device).

    `source` is an iterable of device batches, or a store directory: then its held-out sequences
    (the first `holdout_sequences` / `holdout_fraction` by the trainer's rule, with the trainer's
    defaults) are read, packed into `batch_tokens` batches and given fixed anchors.
    Returns {"loss", "acc", "acc_by_pos" (k = 1..B-1), "tau", "blocks", "sequences"} and, with `path`,
    the path tau of those sequences (see `evaluate_batches`).
    """
    block_size = drafter.cfg.block_size
    if not isinstance(source, (str, Path)):
        return evaluate_batches(drafter, source, block_size=block_size, gamma=gamma, autocast=autocast, path=path)
    from train.data import heldout_batches

    with heldout_batches(source, drafter.cfg, device=next(drafter.parameters()).device,
                         max_anchors=max_anchors, holdout_sequences=holdout_sequences,
                         holdout_fraction=holdout_fraction, batch_tokens=batch_tokens,
                         reader_threads=reader_threads, autocast=autocast) as batches:
        return evaluate_batches(drafter, batches, block_size=block_size, gamma=gamma, autocast=autocast, path=path)


def path_tau_offline(drafter: torch.nn.Module, store: str | Path, *, block_size: int | None = None,
                     max_new_tokens: int | None = None, holdout_sequences: int = 256, holdout_fraction: float = 0.0,
                     batch_tokens: int = 65536, reader_threads: int = 4, autocast: str = "none") -> dict[str, Any]:
    """Path tau of a store's held-out responses as dflash-eval would decode them (`block_size`,
    `max_new_tokens`): every held-out sequence with at least 2 response tokens (one cycle), not only
    those with 2B that training keeps, so it covers the prompts dflash-eval decodes."""
    from train.data import heldout_batches

    with heldout_batches(store, drafter.cfg, device=next(drafter.parameters()).device, max_anchors=1,
                         holdout_sequences=holdout_sequences, holdout_fraction=holdout_fraction,
                         batch_tokens=batch_tokens, reader_threads=reader_threads, autocast=autocast,
                         min_response=2) as batches:
        return path_tau_batches(drafter, batches, block_size=block_size, max_new_tokens=max_new_tokens,
                                autocast=autocast)

