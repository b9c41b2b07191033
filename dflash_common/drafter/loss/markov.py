"""The DSpark drafter's loss: the fused LM-head loss (hard.py, or a soft kind of soft.py) with the
Markov head's bias inside the logits, giving the Markov weights their gradients too, never
materialising [N, V] logits.

    markov_lm_head_loss(hidden [N, H], lm_head [V, H], markov_embed [N, r], markov_w2 [V, r],
                        labels [N], block_size B, weigh)
        -> MarkovLossOutput(
               loss = sum_i w_i * loss_i (float32 scalar; grad wrt hidden, markov_embed, markov_w2),
               correct = argmax == label [N] bool, ce = CE to the label [N] float32,
               weights = w [N] float32, tv = total variation to the target [N] or None)

    logits_i = hidden_i @ W^T + markov_embed_i @ W2^T   (markov_embed_i: W1[row i's previous token])

Rows are whole blocks, in order (N = A * B). `weigh(ce [n, B], valid [n, B], first_block)` gives the
rows' weights from their own CE, a block at a time (D-PACE), or looks them up (the gamma decay).

Why the weights are formed inside. The hard and soft losses keep, per row, d row_loss / d hidden:
row i of the loss depends on row i of hidden only, so weights that come from the same forward
(D-PACE) just scale the stored rows in the backward. The Markov weights break that: d loss / d W2 =
sum_i g_i d_i^T e_i (d_i the logits gradient of row i, [V]) is a sum over rows, and the row factors
g_i must be known while d_i exists, inside the chunk. So every chunk holds whole blocks: its kernel
writes the *unit*-weight gradient d_i over the logits and returns the rows' CE, `weigh` turns those
into the blocks' weights, and they enter through the small operands only:
    grad hidden_i = w_i (d_i @ W),  grad e_i = w_i (d_i @ W2),  grad W2 += D^T (w * E)
(row scalings of [c, H], [c, r] and [c, r]: no extra pass over the [c, V] chunk). The function
returns the weighted sum as one scalar, so the backward only scales by the incoming gradient.

Cost against DFlash's hard loss (hard.py, 4NVH): the bias adds 6NVr (its logits and the embedding's
gradient ride in the two matmuls of the lm_head, widened from H to H + r; W2's gradient is one more
matmul, the only extra pass over a [c, V] chunk): +6r/(4H), +9.4% at r = 256 and H = 4096; the
weights cost a few [n, B] ops a chunk. DSpark's rows are all predictions (DFlash drops row 0: B-1
of B). Memory: the [N, H] and [N, r] stored gradients, W2's float32 gradient [V, r], the lm_head beside W2
([V, H + r], one copy a call), one logits chunk (two with a soft kind).

Backends as hard.py's and soft.py's ('auto', 'triton', 'torch'); the hard rows use the exact method.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from dflash_common.drafter.loss.hard import (
    Backend,
    chunk_rows,
    resolve_backend,
    weighted_ce_rows_torch,
)
from dflash_common.drafter.loss.soft import MIX, SoftKind, soft_chunk_rows, soft_rows_torch
from dflash_common.drafter.objective import IGNORE_INDEX

# weigh(ce [n, B], valid [n, B], first_block) -> weights [n, B] float32 (no gradient)
Weigh = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class MarkovLossOutput(NamedTuple):
    loss: torch.Tensor  # float32 scalar: the weighted sum
    correct: torch.Tensor  # [N] bool: argmax of the corrected logits == label
    ce: torch.Tensor  # [N] float32, no grad: CE of the corrected logits (0 where not valid)
    weights: torch.Tensor  # [N] float32, no grad: the weights `weigh` gave
    # [N] float32, no grad: 1/2 sum |p - q| (0 where not valid; soft kinds tv and dspark only)
    tv: torch.Tensor | None = None


class Soft(NamedTuple):
    """A soft kind's inputs (soft.py): the target's final states, the one each block row reads."""

    teacher: torch.Tensor  # [M, H]
    teacher_index: torch.Tensor  # [N]
    kind: SoftKind
    temperature: float = 1.0


def markov_lm_head_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    markov_embed: torch.Tensor,
    markov_w2: torch.Tensor,
    labels: torch.Tensor,
    block_size: int,
    weigh: Weigh,
    soft: Soft | None = None,
    backend: Backend = "auto",
    chunk_bytes: int | None = None,
) -> MarkovLossOutput:
    """See the module docstring."""
    n, h = hidden.shape
    v, r = markov_w2.shape
    if lm_head_weight.shape != (v, h) or markov_embed.shape != (n, r):
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, lm_head {tuple(lm_head_weight.shape)}, markov_embed "
            f"{tuple(markov_embed.shape)} and markov_w2 {tuple(markov_w2.shape)} do not match"
        )
    if labels.shape != (n,) or n % block_size:
        raise ValueError(
            f"labels need one entry per row, and the rows ({n}) whole blocks of {block_size}"
        )
    if soft is not None and soft.kind not in MIX:
        raise ValueError(f"soft loss kind {soft.kind!r} unknown; use one of {sorted(MIX)}")
    spec = _MarkovSpec(resolve_backend(backend, hidden.device), chunk_bytes, block_size, weigh, soft)
    args = (hidden, markov_embed, markov_w2, lm_head_weight.detach(), labels)
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in args[:3])
    if not need_grad:
        return _chunks(*args, spec, need_grad=False)[0]
    loss, correct, ce, weights, tv = _MarkovLoss.apply(*args, spec)
    return MarkovLossOutput(
        loss, correct, ce, weights, tv if soft is not None and _has_tv(soft) else None
    )


class _MarkovSpec(NamedTuple):
    backend: str
    chunk_bytes: int | None
    block_size: int
    weigh: Weigh
    soft: Soft | None


def _has_tv(soft: Soft) -> bool:
    """TV is recovered from the row loss when the kind mixes CE and L1 only (tv, dspark)."""
    _, a_kl, a_l1 = MIX[soft.kind]
    return a_kl == 0 and a_l1 > 0 and soft.temperature == 1.0


class _MarkovLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, markov_embed, markov_w2, weight, labels, spec):
        out, grads = _chunks(hidden, markov_embed, markov_w2, weight, labels, spec, need_grad=True)
        ctx.grads = grads  # (hidden, markov_embed, markov_w2), already weighted
        tv = out.tv if out.tv is not None else out.ce.new_zeros(0)
        ctx.mark_non_differentiable(out.correct, out.ce, out.weights, tv)
        return out.loss, out.correct, out.ce, out.weights, tv

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("markov_lm_head_loss supports one backward pass per forward")
        g_hidden, g_embed, g_w2 = (t.mul_(grad_loss.to(t.dtype)) for t in grads)
        return g_hidden, g_embed, g_w2, None, None, None


def _rows_per_chunk(hidden: torch.Tensor, weight: torch.Tensor, spec: _MarkovSpec) -> int:
    """The byte budget's rows (hard.py's and soft.py's rule), rounded down to whole blocks."""
    n, b = hidden.shape[0], spec.block_size
    if spec.soft is not None:
        rows = soft_chunk_rows(n, hidden, weight, spec.backend, spec.chunk_bytes)
    else:
        per_value = weight.element_size() + (4 if spec.backend == "torch" else 0)
        rows = chunk_rows(
            n, hidden.shape[1], weight.shape[0], per_value, hidden.element_size(), spec.chunk_bytes
        )
    return max(b, rows // b * b)


def _chunks(hidden, markov_embed, markov_w2, weight, labels, spec: _MarkovSpec, need_grad: bool):
    """(MarkovLossOutput, (grad hidden, grad markov_embed, grad markov_w2) or None).

    The lm_head and W2 side by side, [V, H + r] (one copy a call): a chunk's logits are then one
    matmul of [hidden | markov_embed] (K = H + r), and the gradients of both one matmul of the unit
    gradient by it, so the bias adds one pass over the [c, V] chunk (W2's gradient), not three."""
    n, h, b = hidden.shape[0], hidden.shape[1], spec.block_size
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, 0).long()  # invalid rows get weight 0 and zero gradient
    unit = valid.float()
    both = torch.cat([weight, markov_w2.detach().to(weight.dtype)], 1)  # [V, H + r]
    f32 = {"dtype": torch.float32, "device": hidden.device}
    loss, ce, weights = torch.zeros((), **f32), torch.zeros(n, **f32), torch.zeros(n, **f32)
    tv = torch.zeros(n, **f32) if spec.soft is not None and _has_tv(spec.soft) else None
    correct = torch.zeros(n, dtype=torch.bool, device=hidden.device)
    if need_grad:
        g_hidden, g_embed = torch.empty_like(hidden), torch.empty_like(markov_embed)
        g_w2 = torch.zeros(markov_w2.shape, **f32)
    step = _rows_per_chunk(hidden, weight, spec)
    for r0 in range(0, n, step):
        rows = slice(r0, min(r0 + step, n))
        e = markov_embed[rows].detach().to(weight.dtype)  # [c, r]
        x = torch.cat([hidden[rows].detach().to(weight.dtype), e], 1)  # [c, H + r]
        logits = x @ both.T  # [c, V]: lm_head(h) + the Markov bias
        # logits become the unit-weight gradient
        row_loss, row_correct, ce[rows], row_tv = _unit_rows(
            spec, weight, logits, safe[rows], unit[rows], rows, need_grad
        )
        correct[rows] = row_correct & valid[rows]
        blocks = (ce[rows].view(-1, b), valid[rows].view(-1, b))
        w = spec.weigh(*blocks, r0 // b).reshape(-1).float() * unit[rows]
        weights[rows] = w
        loss = loss + (w * row_loss).sum()
        if tv is not None:
            tv[rows] = row_tv
        if need_grad:
            ws = w[:, None]
            g = (logits @ both).mul_(ws.to(logits.dtype))  # [c, V] @ [V, H + r]
            g_hidden[rows], g_embed[rows] = g[:, :h], g[:, h:]
            g_w2 += (logits.T @ (e.float() * ws).to(logits.dtype)).float()  # [V, c] @ [c, r]
        del logits
    out = MarkovLossOutput(loss, correct, ce, weights, tv)
    return out, ((g_hidden, g_embed, g_w2.to(markov_w2.dtype)) if need_grad else None)


def _unit_rows(spec: _MarkovSpec, weight, logits, labels, unit, rows, need_grad):
    """Per row of the chunk under unit weights (0 on invalid rows): (loss, correct, CE, TV or None);
    with need_grad, logits [c, V] becomes d loss_row / d logits, row by row."""
    soft = spec.soft
    if soft is None:
        if spec.backend == "triton":
            from dflash_common.drafter.loss.hard_triton import weighted_ce_rows

            loss, correct = weighted_ce_rows(logits, labels, unit, need_grad)
        else:
            loss, correct = weighted_ce_rows_torch(logits, labels, unit, need_grad)
        return loss, correct, loss, None
    teacher = soft.teacher[soft.teacher_index[rows]].detach().to(weight.dtype)
    target = teacher @ weight.T  # [c, V], the target's logits
    mix = MIX[soft.kind]
    if spec.backend == "triton":
        from dflash_common.drafter.loss.soft_triton import soft_rows

        loss, correct, ce = soft_rows(
            logits, target, labels, unit, mix, soft.temperature, need_grad
        )
    else:
        loss, correct, ce = soft_rows_torch(
            logits, target, labels, unit, mix, soft.temperature, need_grad
        )
    ce = ce * unit
    # loss = a_ce CE + a_l1 * 2 TV
    tv = (loss - mix[0] * ce) / (2 * mix[2]) if _has_tv(soft) else None
    return loss, correct, ce, tv
