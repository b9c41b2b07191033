"""Soft targets: the drafter's distribution matched to the target's, through the frozen lm_head, in
row chunks that never materialise [N, V] logits (the soft twin of hard.py; same design and backends).

    soft_lm_head_loss(hidden [N, H], lm_head [V, H], labels int64 [N], weights [N],
                      teacher [M, H], teacher_index [N], kind, temperature)
        -> LossOutput(loss = sum_i w_i * loss_kind(row i)  (float32 scalar, grad wrt hidden),
                      correct = argmax == label  [N] bool,
                      rows = w_i * loss_kind(row i)  [N] float32, with grad wrt hidden,
                      ce = CE(hidden_i @ W^T, label_i)  [N] float32, unweighted, no grad)

As with the hard loss, weights computed from the same forward (D-PACE, from `ce`: the drafter's
probability of the label) need no second pass: run with unit weights on the valid rows and
backpropagate (w * rows).sum(); row i of the loss depends on row i of hidden only, so the backward
scales row i of the stored gradient by the gradient arriving at rows[i].

The target's distribution for row i comes from its final (normed) hidden state
`teacher[teacher_index[i]]` (precompute's `store.final_state`) through the same lm_head:
q = softmax(teacher_row @ W^T / T), p = softmax(hidden_row @ W^T / T), T = `temperature`. For a
block row at anchor a, position k (predicting token a + k) the teacher row is a + k - 1: the target's
final state there is what its lm_head turns into its prediction of token a + k.

Kinds (per row, before the row weight):
- 'ce':     CE(hidden_row @ W^T, label) (temperature-free), with labels that may be TARGET_ARGMAX
- 'kl':     KL(q || p) = sum q (log q - log p)   (forward KL: CE with soft targets less q's entropy)
- 'tv':     total variation 1/2 sum |p - q|
- 'dspark': 0.1 CE + 0.9 sum |p - q|  (DSpark's mix; the CE term is temperature-free)

A label TARGET_ARGMAX means "the target's greedy prediction": argmax of the teacher row's logits,
resolved inside the kernel (prompt anchors, objective docs); `correct` compares against it too.

Cost per chunk of c rows: two logits matmuls (drafter, target: 2 x 2cVH) + the gradient matmul
(2cVH): 6NVH in all, 1.5x the hard loss. Memory: the [N, H] gradient plus two logits chunks
([c, V] each, plus float32 copies on the torch backend); `chunk_rows` sizes c from `chunk_bytes`
counting both, so the bound is explicit and results do not depend on it (tests check both).
"""

from __future__ import annotations

from typing import Literal

import torch

from dflash_common.drafter.loss.hard import Backend, LossOutput, chunk_rows, resolve_backend
from dflash_common.drafter.objective import IGNORE_INDEX

SoftKind = Literal["ce", "kl", "tv", "dspark"]
TARGET_ARGMAX = -1  # label of a row taught the target's own greedy token (resolved in the kernel)
# (CE, KL, L1) coefficients of each kind; TV is half the L1 distance, DSpark 0.1 CE + 0.9 L1
MIX: dict[str, tuple[float, float, float]] = {
    "ce": (1.0, 0.0, 0.0), "kl": (0.0, 1.0, 0.0), "tv": (0.0, 0.0, 0.5), "dspark": (0.1, 0.0, 0.9),
}


def soft_kind(soft: str) -> SoftKind:
    """The kernel's kind for the trainer's `targets.soft`: 'none' (with prompt anchors) is CE."""
    return "ce" if soft == "none" else soft  # type: ignore[return-value]


def teacher_rows(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[A, B] packed positions of the final states that give the target's distribution of each block
    row: a + k - 1 for the token at a + k (k = 0 is never a prediction; clamped to stay in range)."""
    k = torch.arange(block_size, device=anchors.device)
    return (anchors[:, None] + k - 1).clamp(min=0)


def greedy_prompt_labels(labels: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """labels [A, B] (from block_labels with every position valid) -> the same, with every label
    outside the loss mask (prompt tokens) replaced by TARGET_ARGMAX: the target's own greedy token."""
    k = torch.arange(labels.shape[1], device=labels.device)
    pos = (anchors[:, None] + k).clamp(max=loss_mask.shape[0] - 1)  # [A, B]
    prompt = (labels != IGNORE_INDEX) & ~loss_mask[pos]
    return torch.where(prompt, TARGET_ARGMAX, labels)


def soft_lm_head_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher: torch.Tensor,
    teacher_index: torch.Tensor,
    kind: SoftKind,
    temperature: float = 1.0,
    backend: Backend = "auto",
    chunk_bytes: int | None = None,
) -> LossOutput:
    """Weighted soft-target loss of hidden [N, H] against teacher rows; see the module docstring."""
    if kind not in MIX:
        raise ValueError(f"soft loss kind {kind!r} unknown; use one of {sorted(MIX)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n, h = hidden.shape
    if lm_head_weight.shape[1] != h or teacher.dim() != 2 or teacher.shape[1] != h:
        raise ValueError(f"hidden {tuple(hidden.shape)}, teacher {tuple(teacher.shape)} and lm_head "
                         f"{tuple(lm_head_weight.shape)} do not match")
    if labels.shape != (n,) or weights.shape != (n,) or teacher_index.shape != (n,):
        raise ValueError("labels, weights and teacher_index need one entry per row of hidden")
    spec = _SoftSpec(kind, float(temperature), resolve_backend(backend, hidden.device), chunk_bytes)
    args = (hidden, lm_head_weight.detach(), labels, weights, teacher.detach(), teacher_index)
    if not (torch.is_grad_enabled() and hidden.requires_grad):
        rows, correct, ce, _ = _chunked_soft_loss(*args, spec, need_grad=False)
        return LossOutput(rows.sum(), correct, rows, ce)
    rows, correct, ce = _SoftLoss.apply(*args, spec)
    return LossOutput(rows.sum(), correct, rows, ce)


class _SoftSpec:
    """What the chunks compute: kind, temperature, backend, chunk budget (one object through autograd)."""

    def __init__(self, kind: str, temperature: float, backend: str, chunk_bytes: int | None):
        self.kind, self.temperature, self.backend, self.chunk_bytes = kind, temperature, backend, chunk_bytes
        self.mix = MIX[kind]


class _SoftLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, teacher, teacher_index, spec):
        rows, correct, ce, grad = _chunked_soft_loss(hidden, weight, labels, weights, teacher, teacher_index,
                                                     spec, need_grad=True)
        ctx.grad_hidden = grad  # [N, H]: row i is d rows[i] / d hidden[i] (no other row depends on it)
        ctx.mark_non_differentiable(correct, ce)
        return rows, correct, ce

    @staticmethod
    def backward(ctx, grad_rows, grad_correct, grad_ce):
        grad, ctx.grad_hidden = ctx.grad_hidden, None
        if grad is None:
            raise RuntimeError("soft_lm_head_loss supports one backward pass per forward")
        return grad.mul_(grad_rows[:, None]), None, None, None, None, None, None


def soft_chunk_rows(n_rows: int, hidden: torch.Tensor, weight: torch.Tensor, backend: str,
                    chunk_bytes: int | None) -> int:
    """Rows per chunk: two logits chunks live at once (drafter and target), plus on the torch
    backend about ten float32 temporaries of a chunk; `chunk_bytes` bounds them all together."""
    per_value = 2 * weight.element_size() + (10 * 4 if backend == "torch" else 0)
    return chunk_rows(n_rows, hidden.shape[1], weight.shape[0], per_value, hidden.element_size(), chunk_bytes)


def _chunked_soft_loss(hidden, weight, labels, weights, teacher, teacher_index, spec: _SoftSpec,
                       need_grad: bool):
    n = hidden.shape[0]
    kept = ((weights != 0) & (labels != IGNORE_INDEX)).nonzero().squeeze(1)  # one host sync
    correct = torch.zeros(n, dtype=torch.bool, device=hidden.device)
    grad = torch.zeros_like(hidden) if need_grad else None
    rows_loss = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    rows_ce = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    step = soft_chunk_rows(n, hidden, weight, spec.backend, spec.chunk_bytes)
    for r0 in range(0, kept.numel(), step):
        rows = kept[r0:r0 + step]
        logits = hidden[rows].to(weight.dtype) @ weight.T  # [c, V]; becomes d loss / d logits in place
        target = teacher[teacher_index[rows]].to(weight.dtype) @ weight.T  # [c, V], the target's logits
        row_loss, row_correct, row_ce = _soft_rows(spec, logits, target, labels[rows],
                                                   weights[rows].float(), need_grad)
        del target
        rows_loss[rows] = row_loss
        rows_ce[rows] = row_ce
        correct[rows] = row_correct
        if need_grad:
            grad[rows] = (logits @ weight).to(grad.dtype)  # [c, V] @ [V, H] -> [c, H]
        del logits  # else the next chunk's matmuls allocate while these are alive
    return rows_loss, correct, rows_ce, grad


def _soft_rows(spec: _SoftSpec, logits, target, labels, weights, compute_grad):
    if spec.backend == "triton":
        from dflash_common.drafter.loss.soft_triton import soft_rows

        return soft_rows(logits, target, labels, weights, spec.mix, spec.temperature, compute_grad)
    return soft_rows_torch(logits, target, labels, weights, spec.mix, spec.temperature, compute_grad)


def soft_rows_torch(logits: torch.Tensor, target: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                    mix: tuple[float, float, float], temperature: float,
                    compute_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel's contract in PyTorch: per-row weighted loss, correctness and unweighted CE
    against the label for drafter logits [C, V] against target logits [C, V]; with compute_grad,
    `logits` is overwritten by the gradient of the summed weighted loss with respect to it."""
    a_ce, a_kl, a_l1 = mix
    x, t = logits.float(), target.float()
    labels = torch.where(labels == TARGET_ARGMAX, t.argmax(-1), labels)  # the target's greedy token
    correct = x.argmax(-1) == labels
    log_p1 = torch.log_softmax(x, -1)  # temperature-free, for CE
    log_p, log_q = torch.log_softmax(x / temperature, -1), torch.log_softmax(t / temperature, -1)
    p, q = log_p.exp(), log_q.exp()
    ce = -log_p1.gather(1, labels[:, None]).squeeze(1)
    loss = torch.zeros_like(weights)
    grad = torch.zeros_like(x) if compute_grad else None
    if a_ce:
        loss += a_ce * ce
        if compute_grad:
            grad += a_ce * (log_p1.exp() - torch.nn.functional.one_hot(labels, x.shape[1]).float())
    if a_kl:
        loss += a_kl * (q * (log_q - log_p)).sum(-1)
        if compute_grad:
            grad += (a_kl / temperature) * (p - q)
    if a_l1:
        sign = torch.sign(p - q)
        loss += a_l1 * (p - q).abs().sum(-1)
        if compute_grad:  # d sum|p - q| / d s = p * (sign - <p, sign>), s = logits / T
            grad += (a_l1 / temperature) * p * (sign - (p * sign).sum(-1, keepdim=True))
    if compute_grad:
        logits.copy_(grad * weights[:, None])
    return loss * weights, correct, ce
