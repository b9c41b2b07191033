"""Triton kernel of the soft-target loss (soft.py): per row of a chunk, the drafter's logits
against the target's, the weighted CE / KL / L1 mix, its gradient with respect to the drafter's
logits (written in place) and argmax correctness, one row per program.

Passes over the row (both logits rows are read each time; all arithmetic is float32):
1. online max / sum-exp per lane of the drafter's logits (raw, for CE and argmax; and divided by
   the temperature when it is not 1) and of the target's logits / T, with both argmaxes;
2. (KL or L1 wanted) the row sums KL(q || p), sum |p - q| and <p, sign(p - q)>, which the L1
   gradient needs before any element of it can be written;
3. (gradient wanted) w * d loss / d logits over the drafter's logits.

Runs on the CPU under TRITON_INTERPRET=1 (the test suite does so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 2048  # two rows per step (drafter and target)
LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp(x):
    """e**x as 2**(x log2 e): one multiply and the hardware's ex2.approx, which makes the soft
    losses 0.5-2% faster on an H200 (benchmarks/soft_loss.py, docs/benchmarks.md)."""
    return tl.exp2(x * LOG2_E)


@triton.jit
def _online(m, s, x):
    """One tile into per-lane running max m and sum s of exp(x - m) (one exp per value)."""
    above = x > m
    e = _exp(-tl.abs(x - m))
    return tl.maximum(m, x), tl.where(above, s * e + 1.0, s + e)


@triton.jit
def _lse(m_lane, s_lane):
    m = tl.max(m_lane, axis=0)
    return m + tl.log(tl.sum(s_lane * _exp(m_lane - m), axis=0))


@triton.jit
def _sign(d):
    return tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))


@triton.jit
def _soft_rows_kernel(
    logits_ptr, target_ptr, row_stride, target_row_stride, labels_ptr, weights_ptr, loss_ptr, correct_ptr, ce_ptr,
    n_cols, a_ce, a_kl, a_l1, inv_t,
    TEMPERED: tl.constexpr, NEED_SUMS: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_ptr = logits_ptr + row * row_stride
    t_ptr = target_ptr + row * target_row_stride
    weight = tl.load(weights_ptr + row).to(tl.float32)

    # pass 1: lane-wise running max / sum-exp / argmax (start at a finite floor: no inf - inf)
    m1 = tl.full([BLOCK], -1.0e30, tl.float32)  # drafter, raw
    s1 = tl.zeros([BLOCK], tl.float32)
    i1 = tl.zeros([BLOCK], tl.int32)
    mp = tl.full([BLOCK], -1.0e30, tl.float32)  # drafter / T
    sp = tl.zeros([BLOCK], tl.float32)
    mq = tl.full([BLOCK], -1.0e30, tl.float32)  # target / T
    sq = tl.zeros([BLOCK], tl.float32)
    iq = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        t = tl.load(t_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) * inv_t
        i1 = tl.where(x > m1, cols, i1)  # strict: a lane keeps the first column of its max
        m1, s1 = _online(m1, s1, x)
        iq = tl.where(t > mq, cols, iq)
        mq, sq = _online(mq, sq, t)
        if TEMPERED:
            mp, sp = _online(mp, sp, x * inv_t)
    lse1 = _lse(m1, s1)
    lse_q = _lse(mq, sq)
    lse_p = lse1
    if TEMPERED:
        lse_p = _lse(mp, sp)
    best = tl.min(tl.where(m1 == tl.max(m1, axis=0), i1, n_cols), axis=0)
    best_q = tl.min(tl.where(mq == tl.max(mq, axis=0), iq, n_cols), axis=0)
    label = tl.load(labels_ptr + row)
    label = tl.where(label == -1, best_q, label)  # -1 = soft.TARGET_ARGMAX: the target's greedy token
    ce = lse1 - tl.load(x_ptr + label).to(tl.float32)
    loss = a_ce * ce
    tl.store(correct_ptr + row, (best == label).to(tl.int8))
    tl.store(ce_ptr + row, ce)

    # pass 2: KL(q || p), sum |p - q| and <p, sign(p - q)> (lanes past the row's end add nothing)
    pg = 0.0
    if NEED_SUMS:
        kl_lane = tl.zeros([BLOCK], tl.float32)
        l1_lane = tl.zeros([BLOCK], tl.float32)
        pg_lane = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < n_cols
            log_p = tl.load(x_ptr + cols, mask=in_row, other=0.0).to(tl.float32) * inv_t - lse_p
            log_q = tl.load(t_ptr + cols, mask=in_row, other=0.0).to(tl.float32) * inv_t - lse_q
            p, q = _exp(log_p), _exp(log_q)
            kl_lane += tl.where(in_row, q * (log_q - log_p), 0.0)
            l1_lane += tl.where(in_row, tl.abs(p - q), 0.0)
            pg_lane += tl.where(in_row, p * _sign(p - q), 0.0)
        loss += a_kl * tl.sum(kl_lane, axis=0) + a_l1 * tl.sum(l1_lane, axis=0)
        pg = tl.sum(pg_lane, axis=0)
    tl.store(loss_ptr + row, loss * weight)

    # pass 3: w * [a_ce (softmax - onehot) + (a_kl (p - q) + a_l1 p (sign - <p, sign>)) / T]
    if COMPUTE_GRAD:
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < n_cols
            x = tl.load(x_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
            p = _exp(x * inv_t - lse_p)
            q = _exp(tl.load(t_ptr + cols, mask=in_row, other=0.0).to(tl.float32) * inv_t - lse_q)
            g = a_ce * (_exp(x - lse1) - tl.where(cols == label, 1.0, 0.0))
            g += inv_t * (a_kl * (p - q) + a_l1 * p * (_sign(p - q) - pg))
            tl.store(x_ptr + cols, (g * weight).to(logits_ptr.dtype.element_ty), mask=in_row)


def soft_rows(logits: torch.Tensor, target: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
              mix: tuple[float, float, float], temperature: float, compute_grad: bool,
              block: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits, target [C, V] (rows contiguous), labels [C] (0..V-1 or TARGET_ARGMAX), weights [C] ->
    (weighted loss per row [C] float32, argmax == label [C] bool, unweighted CE to the label [C]
    float32); with compute_grad, logits is overwritten by the gradient of the summed weighted loss
    with respect to it."""
    c, v = logits.shape
    if logits.stride(1) != 1 or target.stride(1) != 1 or target.shape != logits.shape:
        raise ValueError("logits and target must be [C, V] alike, rows contiguous")
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    correct = torch.empty(c, dtype=torch.int8, device=logits.device)
    ce = torch.empty(c, dtype=torch.float32, device=logits.device)
    if c == 0:
        return loss, correct.bool(), ce
    a_ce, a_kl, a_l1 = mix
    block = block or min(MAX_BLOCK, triton.next_power_of_2(v))
    _soft_rows_kernel[(c,)](
        logits, target, logits.stride(0), target.stride(0), labels.contiguous(), weights.float().contiguous(),
        loss, correct, ce, v, float(a_ce), float(a_kl), float(a_l1), 1.0 / temperature,
        TEMPERED=temperature != 1.0, NEED_SUMS=bool(a_kl or a_l1), COMPUTE_GRAD=compute_grad, BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return loss, correct.bool(), ce
