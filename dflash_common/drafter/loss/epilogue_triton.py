"""The label-odds loss with its row work inside the logits matmul (hard.py, method 'odds_epilogue').

A Triton matmul computes a chunk's logits tile by tile, hidden_chunk [C, H] @ W^T; while a tile
[BM, BN] is still in registers, in float32, it becomes the odds exp(x - x_label) (0 at the label)
and is stored in the weight's dtype. Per (row, column tile) the kernel also keeps the odds' sum and
whether a column beats the label; a small kernel folds those per row into the loss, correctness and
the gradient's coefficients (hard_triton.odds_outputs). The logits themselves are never stored: the
chunk is written once, by the matmul, and read once, by the gradient matmul (cuBLAS), where the
'odds' method also writes the logits and reads them back once more before that.

x_label = hidden_i . W[label_i] is needed before the first tile: one float32 dot product a row over
the same bf16 inputs (label_logits); the matmul's own value of that column differs from it by the
order of summation only. Correctness (argmax == label) is judged on these float32 logits, where the
other methods judge the logits rounded to bf16: a near-tie may fall the other way.

Tile shapes are chosen per (C, V, H) by triton.autotune on CUDA, among the configurations below; on
the CPU (TRITON_INTERPRET=1, the tests) one small shape runs, and the tiles are cast to float32
before the dot (the interpreter's bf16 dot is wrong; bf16 x bf16 products are exact in float32, so
the results are the GPU's up to the order of summation).

Runs on the CPU under TRITON_INTERPRET=1 (the test suite does so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_common.drafter.loss.hard_triton import LOG2_E, store_odds_outputs

# (BM, BN, BK, warps, stages): Hopper-sized tiles; BN >= MIN_BN so that the per-tile partial sums
# fit a buffer of cdiv(V, MIN_BN) columns whatever shape the tuner takes.
CONFIGS = [
    triton.Config({"BM": 128, "BN": 256, "BK": 64}, num_warps=8, num_stages=3),
    triton.Config({"BM": 128, "BN": 256, "BK": 64}, num_warps=8, num_stages=4),
    triton.Config({"BM": 128, "BN": 128, "BK": 64}, num_warps=8, num_stages=4),
    triton.Config({"BM": 128, "BN": 128, "BK": 64}, num_warps=4, num_stages=4),
    triton.Config({"BM": 64, "BN": 256, "BK": 64}, num_warps=4, num_stages=4),
    triton.Config({"BM": 128, "BN": 256, "BK": 32}, num_warps=8, num_stages=5),
]
MIN_BN = 32
CPU_CONFIG = {
    "BM": 16,
    "BN": 32,
    "BK": 16,
}  # the interpreter's shape: small, so tests tile a small vocabulary


@triton.jit
def _label_logit_kernel(
    h_ptr, h_stride, w_ptr, w_stride, labels_ptr, out_ptr, K, BLOCK: tl.constexpr
):
    """out[i] = hidden_i . W[label_i] in float32."""
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        h = tl.load(h_ptr + row * h_stride + ks, mask=ks < K, other=0.0).to(tl.float32)
        acc += h * tl.load(w_ptr + label * w_stride + ks, mask=ks < K, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


@triton.jit
def _odds_matmul_kernel(
    h_ptr,
    h_stride,
    w_ptr,
    w_stride,
    odds_ptr,
    odds_stride,
    ref_ptr,
    labels_ptr,
    t_part_ptr,
    beat_part_ptr,
    part_stride,
    M,
    N,
    K,
    tune_m,
    COMPUTE_GRAD: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # row tiles vary fastest: the programs that run together share one tile of W, read from memory
    # once and then from L2 (a chunk is a few row tiles high and hundreds of column tiles wide)
    pid = tl.program_id(0)
    n_tiles_m = tl.cdiv(M, BM)
    pid_m, pid_n = pid % n_tiles_m, pid // n_tiles_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    row_in, col_in = rm < M, rn < N
    a_ptrs = h_ptr + rm[:, None].to(tl.int64) * h_stride + rk[None, :]  # [BM, BK]
    b_ptrs = w_ptr + rn[None, :].to(tl.int64) * w_stride + rk[:, None]  # [BK, BN]: a tile of W^T
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        # every step whole when BK divides K (hidden sizes do): no K mask
        k_in = (rk < K - k0) | EVEN_K
        a = tl.load(a_ptrs, mask=row_in[:, None] & k_in[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=col_in[None, :] & k_in[:, None], other=0.0)
        # the interpreter's bf16 dot reads the raw bits as integers; float32 products are exact
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)  # [BM, BN] logits, float32
        a_ptrs += BK
        b_ptrs += BK

    # epilogue: the tile's odds against each row's label, their sum, and whether a column beats the
    # label
    ref = tl.load(ref_ptr + rm, mask=row_in, other=0.0)
    label = tl.load(labels_ptr + rm, mask=row_in, other=-1)
    diff = acc - ref[:, None]
    outside = (rn[None, :] == label[:, None]) | ~(row_in[:, None] & col_in[None, :])
    odds = tl.where(outside, 0.0, tl.exp2(diff * LOG2_E))
    beat = ((diff > 0) | ((diff == 0) & (rn[None, :] < label[:, None]))) & ~outside
    part = rm.to(tl.int64) * part_stride + pid_n
    tl.store(t_part_ptr + part, tl.sum(odds, axis=1), mask=row_in)
    tl.store(beat_part_ptr + part, tl.max(beat.to(tl.int32), axis=1).to(tl.int8), mask=row_in)
    if COMPUTE_GRAD:
        out = odds_ptr + rm[:, None].to(tl.int64) * odds_stride + rn[None, :]
        tl.store(out, odds.to(odds_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


# tune_m (the chunk height's power of two) keys the tuning, not M: a batch's last chunk has a height
# of its own, and tuning again for each would cost more than the shape saves
_odds_matmul_tuned = triton.autotune(configs=CONFIGS, key=["tune_m", "N", "K"])(
    triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BK"] == 0})(_odds_matmul_kernel)
)


@triton.jit
def _odds_fold_kernel(
    t_part_ptr,
    beat_part_ptr,
    part_stride,
    n_parts,
    weights_ptr,
    index_ptr,
    loss_ptr,
    correct_ptr,
    scale_ptr,
    label_coef_ptr,
    ok_ptr,
    log_limit,
    HAS_INDEX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per row: the column tiles' sums and beats folded, then hard_triton's row outputs."""
    row = tl.program_id(0).to(tl.int64)
    t_lane = tl.zeros([BLOCK], tl.float32)
    beat_lane = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, n_parts, BLOCK):
        js = j0 + tl.arange(0, BLOCK)
        t_lane += tl.load(t_part_ptr + row * part_stride + js, mask=js < n_parts, other=0.0)
        beat_lane = beat_lane | tl.load(
            beat_part_ptr + row * part_stride + js, mask=js < n_parts, other=0
        ).to(tl.int32)
    weight = tl.load(weights_ptr + row).to(tl.float32)
    out = tl.load(index_ptr + row) if HAS_INDEX else row
    store_odds_outputs(
        tl.sum(t_lane, axis=0),
        tl.max(beat_lane, axis=0),
        weight,
        log_limit,
        out,
        loss_ptr,
        correct_ptr,
        scale_ptr,
        label_coef_ptr,
        ok_ptr,
    )


def label_logits(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[C] float32: h [C, H] . W[labels] row by row."""
    c, k = h.shape
    out = torch.empty(c, dtype=torch.float32, device=h.device)
    if c:
        _label_logit_kernel[(c,)](
            h,
            h.stride(0),
            weight,
            weight.stride(0),
            labels.contiguous(),
            out,
            k,
            BLOCK=min(1024, triton.next_power_of_2(k)),
            num_warps=4,
        )
    return out


def odds_matmul(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    compute_grad: bool,
    out: tuple[torch.Tensor, ...],
    log_limit: float,
    index: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """h [C, H] (rows contiguous), weight [V, H], labels [C] in 0..V-1, weights [C] float32: the
    same results as hard_triton.label_odds_rows on the logits h @ W^T, into out = (loss, correct,
    scale, label_coef, ok) at rows `index` (or 0..C-1). Returns the odds [C, V] in the weight's
    dtype (0 at each label) when compute_grad, else None (nothing [C, V] is stored)."""
    c, k = h.shape
    v = weight.shape[0]
    if c == 0:
        return torch.empty(0, v, dtype=weight.dtype, device=h.device) if compute_grad else None
    if h.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("hidden and lm_head rows must be contiguous")
    labels = labels.contiguous()
    ref = label_logits(h, weight, labels)
    # ref: an unused pointer
    odds = torch.empty(c, v, dtype=weight.dtype, device=h.device) if compute_grad else ref
    part_stride = triton.cdiv(v, MIN_BN)
    t_part = torch.empty(c, part_stride, dtype=torch.float32, device=h.device)
    beat_part = torch.empty(c, part_stride, dtype=torch.int8, device=h.device)
    args = (
        h,
        h.stride(0),
        weight,
        weight.stride(0),
        odds,
        odds.stride(0),
        ref,
        labels,
        t_part,
        beat_part,
        part_stride,
        c,
        v,
        k,
        triton.next_power_of_2(c),
    )
    if h.device.type == "cuda":
        grid = lambda meta: (triton.cdiv(c, meta["BM"]) * triton.cdiv(v, meta["BN"]),)  # noqa: E731
        _odds_matmul_tuned[grid](*args, COMPUTE_GRAD=compute_grad, DOT_F32=False)
        bn = _odds_matmul_tuned.best_config.kwargs["BN"]  # the shape this launch ran with
    else:
        bn = CPU_CONFIG["BN"]
        grid = (triton.cdiv(c, CPU_CONFIG["BM"]) * triton.cdiv(v, bn),)
        _odds_matmul_kernel[grid](
            *args,
            COMPUTE_GRAD=compute_grad,
            DOT_F32=True,
            EVEN_K=k % CPU_CONFIG["BK"] == 0,
            **CPU_CONFIG,
        )
    loss, correct, scale, label_coef, ok = out
    n_parts = triton.cdiv(v, bn)
    has_index = index is not None
    _odds_fold_kernel[(c,)](
        t_part,
        beat_part,
        part_stride,
        n_parts,
        weights.float().contiguous(),
        index.contiguous() if has_index else loss,  # loss: a pointer never read
        loss,
        correct.view(torch.int8),
        scale,
        label_coef,
        ok.view(torch.int8),
        float(log_limit),
        HAS_INDEX=has_index,
        BLOCK=min(1024, triton.next_power_of_2(n_parts)),
        num_warps=4,
    )
    return odds if compute_grad else None
