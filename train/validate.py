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

from dflash_common.drafter.objective import AcceptanceCounts
from train.objective import batch_objective
from train.path_tau import path_counts, replay_batch, response_segments, summarize_path


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

