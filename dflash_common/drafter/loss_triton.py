"""Triton kernel of the fused LM-head loss: weighted cross-entropy, its gradient with respect to the
logits (written in place) and argmax correctness, one row of a logits chunk per program.

The matmuls around it (hidden @ W^T before, d_logits @ W after) stay in cuBLAS; see loss.py for the
design and why this split costs 4·N·V·H FLOPs. The kernel streams each row twice: an online
max / sum-exp / argmax pass kept per lane, then (when a gradient is wanted) a pass writing
w * (softmax - onehot) over the logits in their own dtype. All arithmetic is float32.

Memory traffic (measured on an H200 by benchmarks/loss.py --kernel-sweep, docs/benchmarks.md):
- pass 1 walks the row from its end, where the logits matmul wrote last and L2 still holds it;
  pass 2 walks it from its start, which pass 1 read last. Both find part of the row in L2.
- e**x is computed as 2**(x log2 e): one multiply and the hardware's ex2.approx. With tl.exp the
  kernel ran 10% slower, memory-bound as it is (three passes over ~150 MB a chunk).
- 8192 columns a step over 32 warps: 8 values a lane, so the per-lane state needs no spills.
Measured slower there (the kernel at f2e7ae6 has them as launch options): a fixed number of
programs walking the rows, L2 eviction hints, per-tile instead of per-lane state, pass 2 from the
row's end, software-pipeline stages.

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
