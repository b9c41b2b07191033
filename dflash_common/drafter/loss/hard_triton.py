"""Triton kernel of the fused LM-head loss: weighted cross-entropy, its gradient with respect to the
logits (written in place) and argmax correctness, one row of a logits chunk per program.

The matmuls around it (hidden @ W^T before, d_logits @ W after) stay in cuBLAS; see hard.py for the
design and why this split costs 4·N·V·H FLOPs. The kernel streams each row twice: an online
max / sum-exp / argmax pass kept per lane, then (when a gradient is wanted) a pass writing
w * (softmax - onehot) over the logits in their own dtype. All arithmetic is float32.

Memory traffic (measured on an H200 by benchmarks/loss.py --kernel-sweep, docs/benchmarks.md):
- pass 1 walks the row from its end, where the logits matmul wrote last and L2 still holds it;
  pass 2 walks it from its start, which pass 1 read last. Both find part of the row in L2.
- e**x is computed as 2**(x log2 e): one multiply and the hardware's ex2.approx; tl.exp makes the
  kernel 10% slower, memory-bound as it is (three passes over ~150 MB a chunk).
- 8192 columns a step over 32 warps: 8 values a lane, so the per-lane state needs no spills.
Slower there (docs/benchmarks.md, "Loss", has the measurements): a fixed number of programs walking
the rows, L2 eviction hints, per-tile instead of per-lane state, pass 2 from the row's end,
software-pipeline stages.

Runs on the CPU under TRITON_INTERPRET=1 (the test suite does so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 8192  # columns per step
NUM_WARPS = 32  # at MAX_BLOCK; fewer on a small vocabulary (at least 8 values a lane)
LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def _weighted_ce_rows_kernel(
    logits_ptr,
    logits_row_stride,
    labels_ptr,
    weights_ptr,
    loss_ptr,
    correct_ptr,
    n_cols,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row)
    weight = tl.load(weights_ptr + row).to(tl.float32)
    x_label = tl.load(row_ptr + label).to(tl.float32)
    n_tiles = tl.cdiv(n_cols, BLOCK)

    # pass 1, from the row's end: every lane keeps its own running max, sum of exp and argmax
    # across tiles, so the loop has no cross-warp reduction; lanes are combined once at the end.
    # The start value is a finite floor, not -inf, so exp(-|x - m|) never sees inf - inf on lanes
    # past the row's end.
    m_lane = tl.full([BLOCK], -1.0e30, tl.float32)
    s_lane = tl.zeros([BLOCK], tl.float32)
    i_lane = tl.zeros([BLOCK], tl.int32)
    for tile in range(0, n_tiles):
        cols = (n_tiles - 1 - tile) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        above = x >= m_lane  # not strict: walking backwards, a lane ends on the first column of its max
        e = tl.exp2(-tl.abs(x - m_lane) * LOG2_E)  # one exp per value: exp(m - x) if above, else exp(x - m)
        s_lane = tl.where(above, s_lane * e + 1.0, s_lane + e)
        i_lane = tl.where(above, cols, i_lane)
        m_lane = tl.maximum(m_lane, x)
    m = tl.max(m_lane, axis=0)
    lse = m + tl.log(tl.sum(s_lane * tl.exp2((m_lane - m) * LOG2_E), axis=0))
    best = tl.min(tl.where(m_lane == m, i_lane, n_cols), axis=0)  # first column holding the max
    tl.store(loss_ptr + row, (lse - x_label) * weight)
    tl.store(correct_ptr + row, (best == label).to(tl.int8))

    # pass 2, from the row's start: d loss / d logits = w * (softmax - onehot(label)), in place
    if COMPUTE_GRAD:
        lse2 = lse * LOG2_E
        for tile in range(0, n_tiles):
            cols = tile * BLOCK + tl.arange(0, BLOCK)
            in_row = cols < n_cols
            x = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
            grad = (tl.exp2(x * LOG2_E - lse2) - tl.where(cols == label, 1.0, 0.0)) * weight
            tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


def weighted_ce_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    compute_grad: bool,
    block: int | None = None,
    num_warps: int | None = None,
    loss_out: torch.Tensor | None = None,
    correct_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [C, V] (rows contiguous), labels [C] in 0..V-1, weights [C] float32 ->
    (weighted loss per row [C] float32, argmax == label [C] bool); with compute_grad, logits is
    overwritten by the gradient of the summed weighted loss with respect to it. loss_out /
    correct_out ([C] float32 / [C] bool, contiguous) receive the results in place of new tensors.
    block / num_warps: the launch shape (columns per step, warps), by default MAX_BLOCK / NUM_WARPS."""
    c, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous")
    loss = torch.empty(c, dtype=torch.float32, device=logits.device) if loss_out is None else loss_out
    correct = torch.empty(c, dtype=torch.bool, device=logits.device) if correct_out is None else correct_out
    if c == 0:
        return loss, correct
    block = block or min(MAX_BLOCK, triton.next_power_of_2(v))
    num_warps = num_warps or min(NUM_WARPS, max(1, block // 256))
    _weighted_ce_rows_kernel[(c,)](
        logits, logits.stride(0), labels.contiguous(), weights.float().contiguous(), loss, correct.view(torch.int8),
        v, COMPUTE_GRAD=compute_grad, BLOCK=block, num_warps=num_warps,
    )
    return loss, correct


# ---- the label-odds method (hard.py): one pass over each row, the softmax taken against the label ----

@triton.jit
def odds_outputs(t, beat, weight, log_limit):
    """A row's results from t = sum over v != label of exp(x_v - x_label) and `beat` (some column
    beats the label: a larger logit, or an equal one at a lower index):
    (w * CE, correct, scale a = w / (1 + t), label coefficient b = -w * t / (1 + t), ok = log t < log_limit).
    CE = log(1 + t) without cancellation for small t (the label almost certain): u - 1 is exact."""
    u = 1.0 + t
    ce = tl.where(u == 1.0, t, tl.log(u) * (t / tl.where(u == 1.0, 1.0, u - 1.0)))
    ok = tl.log(t) < log_limit  # False for inf and NaN: such rows are recomputed exactly (t = 0: -inf, ok)
    return ce * weight, beat == 0, weight / u, -weight * (t / u), ok


@triton.jit
def store_odds_outputs(t, beat, weight, log_limit, out, loss_ptr, correct_ptr, scale_ptr, label_coef_ptr, ok_ptr):
    loss, correct, scale, label_coef, ok = odds_outputs(t, beat, weight, log_limit)
    tl.store(loss_ptr + out, loss)
    tl.store(correct_ptr + out, correct.to(tl.int8))
    tl.store(scale_ptr + out, scale)
    tl.store(label_coef_ptr + out, label_coef)
    tl.store(ok_ptr + out, ok.to(tl.int8))


@triton.jit
def _label_odds_rows_kernel(
    logits_ptr,
    logits_row_stride,
    labels_ptr,
    weights_ptr,
    index_ptr,
    loss_ptr,
    correct_ptr,
    scale_ptr,
    label_coef_ptr,
    ok_ptr,
    n_cols,
    log_limit,
    COMPUTE_GRAD: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row)
    weight = tl.load(weights_ptr + row).to(tl.float32)
    ref = tl.load(row_ptr + label).to(tl.float32)  # the label's logit, read before it is overwritten
    n_tiles = tl.cdiv(n_cols, BLOCK)

    # one pass, from the row's end (where the logits matmul wrote last and L2 still holds it): each
    # lane sums exp(x - x_label) over the columns other than the label and notes any column that
    # beats the label; the odds, zero at the label, are written over the logits in their own dtype.
    t_lane = tl.zeros([BLOCK], tl.float32)
    beat_lane = tl.zeros([BLOCK], tl.int32)
    for tile in range(0, n_tiles):
        cols = (n_tiles - 1 - tile) * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < n_cols
        x = tl.load(row_ptr + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        odds = tl.where(cols == label, 0.0, tl.exp2((x - ref) * LOG2_E))  # 0 past the row's end (x = -inf)
        t_lane += odds
        beat_lane = beat_lane | ((x > ref) | ((x == ref) & (cols < label))).to(tl.int32)
        if COMPUTE_GRAD:
            tl.store(row_ptr + cols, odds.to(logits_ptr.dtype.element_ty), mask=in_row)
    out = tl.load(index_ptr + row) if HAS_INDEX else row  # results straight into their rows of the batch
    store_odds_outputs(tl.sum(t_lane, axis=0), tl.max(beat_lane, axis=0), weight, log_limit, out, loss_ptr,
                       correct_ptr, scale_ptr, label_coef_ptr, ok_ptr)


def label_odds_rows(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, compute_grad: bool,
                    out: tuple[torch.Tensor, ...], log_limit: float, index: torch.Tensor | None = None,
                    block: int | None = None) -> None:
    """logits [C, V] (rows contiguous), labels [C] in 0..V-1, weights [C] float32. Per row, into
    out = (loss, correct, scale, label_coef, ok) ([N] float32, bool, float32, float32, bool) at rows
    `index` [C] (or rows 0..C-1 when None): see odds_outputs (log_limit: hard.ODDS_LOG_LIMIT). With
    compute_grad, logits is overwritten by the odds exp(x - x_label), 0 at the label (the gradient is
    scale * odds @ W + label_coef * W[label]: hard.py). block: columns per step, by default as
    weighted_ce_rows."""
    c, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous")
    if c == 0:
        return
    loss, correct, scale, label_coef, ok = out
    block = block or min(MAX_BLOCK, triton.next_power_of_2(v))
    has_index = index is not None
    _label_odds_rows_kernel[(c,)](
        logits, logits.stride(0), labels.contiguous(), weights.float().contiguous(),
        index.contiguous() if has_index else loss,  # loss: a pointer never read
        loss, correct.view(torch.int8), scale, label_coef, ok.view(torch.int8), v, float(log_limit),
        COMPUTE_GRAD=compute_grad, HAS_INDEX=has_index, BLOCK=block,
        num_warps=min(NUM_WARPS, max(1, block // 256)),
    )


@triton.jit
def _odds_grad_kernel(grad_ptr, grad_stride, w_ptr, w_stride, labels_ptr, scale_ptr, label_coef_ptr, g_ptr, n_cols,
                      BLOCK: tl.constexpr):
    """grad[i] = g_i * (scale_i * grad[i] + label_coef_i * W[label_i]), in place, in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < n_cols
    g = tl.load(g_ptr + row).to(tl.float32)
    a = tl.load(scale_ptr + row) * g
    b = tl.load(label_coef_ptr + row) * g
    x = tl.load(grad_ptr + row * grad_stride + cols, mask=in_row, other=0.0).to(tl.float32) * a
    if b != 0.0:  # rows skipped by the loss have no label to read
        label = tl.load(labels_ptr + row).to(tl.int64)
        x += b * tl.load(w_ptr + label * w_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(grad_ptr + row * grad_stride + cols, x.to(grad_ptr.dtype.element_ty), mask=in_row)


def odds_grad(grad: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
              label_coef: torch.Tensor, grad_rows: torch.Tensor) -> torch.Tensor:
    """grad [N, H] (each row sum_v odds_v W_v) becomes, in place, row i times grad_rows[i] of
    d loss_i / d hidden_i = scale_i * grad[i] + label_coef_i * W[labels_i]."""
    n, h = grad.shape
    if n == 0:
        return grad
    block = min(1024, triton.next_power_of_2(h))
    _odds_grad_kernel[(n, triton.cdiv(h, block))](
        grad, grad.stride(0), weight, weight.stride(0), labels.contiguous(), scale, label_coef,
        grad_rows.float().contiguous(), h, BLOCK=block, num_warps=4,
    )
    return grad
