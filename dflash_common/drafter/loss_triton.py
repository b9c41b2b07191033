"""Triton kernel of the fused LM-head loss: weighted cross-entropy, its gradient with respect to the
logits (written in place) and argmax correctness, one row of a logits chunk at a time per program.

The matmuls around it (hidden @ W^T before, d_logits @ W after) stay in cuBLAS; see loss.py for the
design and why this split costs 4·N·V·H FLOPs. The kernel streams each row twice: an online
max / sum-exp / argmax pass, then (when a gradient is wanted) a pass writing
w * (softmax - onehot) over the logits in their own dtype. All arithmetic is float32.

Memory traffic: the second pass re-reads the row the first pass just read. If every row of a chunk
is in flight at once (one program per row, several programs per SM), the chunk (~150 MB) is far
larger than the L2 cache and the re-read goes to HBM: three passes over memory. With `programs`
set, a fixed number of programs walks the rows (program p takes rows p, p + programs, ...), so only
that many rows are in flight and the re-read can hit L2: two passes over HBM.

Runs on the CPU under TRITON_INTERPRET=1 (the test suite does so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The launch shape when the caller names none (benchmarks/loss.py --kernel-sweep times the others on
# an H200): columns per step (capped at the vocabulary's power of two), warps, programs per SM walking
# the rows (None: one program per row), per-lane running state, L2 eviction hints, the passes' order,
# exp through exp2, software-pipeline stages (None: Triton's default).
DEFAULT_LAUNCH = dict(block=4096, num_warps=16, programs_per_sm=None, lane_state=True, l2_hints=False,
                      reverse_first=False, reverse_second=False, exp2=False, num_stages=None)


LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp(x, EXP2: tl.constexpr):
    """e**x; with EXP2 as 2**(x * log2 e), one multiply and the hardware's ex2.approx."""
    if EXP2:
        return tl.exp2(x * LOG2_E)
    return tl.exp(x)


@triton.jit
def _tile_cols(tile, n_tiles, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """Columns of the tile-th step over a row, from its start, or from its end when REVERSE."""
    if REVERSE:
        return (n_tiles - 1 - tile) * BLOCK + tl.arange(0, BLOCK)
    return tile * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _weighted_ce_rows_kernel(
    logits_ptr,
    logits_row_stride,
    labels_ptr,
    weights_ptr,
    loss_ptr,
    correct_ptr,
    n_rows,
    n_cols,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    LANE_STATE: tl.constexpr,
    FIRST_EVICT: tl.constexpr,
    SECOND_EVICT: tl.constexpr,
    REVERSE_FIRST: tl.constexpr,
    REVERSE_SECOND: tl.constexpr,
    EXP2: tl.constexpr,
):
    # int64 rows: row * logits_row_stride passes 2**31 on a chunk of ~14k rows of a 151,936 vocabulary
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        row_ptr = logits_ptr + row * logits_row_stride
        label = tl.load(labels_ptr + row)
        weight = tl.load(weights_ptr + row).to(tl.float32)
        x_label = tl.load(row_ptr + label).to(tl.float32)
        n_tiles = tl.cdiv(n_cols, BLOCK)

        # pass 1: online max, sum of exp and argmax. LANE_STATE: every lane keeps its own running
        # state across tiles, so the loop has no cross-warp reduction and lanes are combined once at
        # the end (more registers); else the tile is reduced each step (fewer registers). The start
        # value is a finite floor, not -inf, so exp(-|x - m|) never sees inf - inf past the row's end.
        if LANE_STATE:
            m_lane = tl.full([BLOCK], -1.0e30, tl.float32)
            s_lane = tl.zeros([BLOCK], tl.float32)
            i_lane = tl.zeros([BLOCK], tl.int32)
            for tile in range(0, n_tiles):
                cols = _tile_cols(tile, n_tiles, BLOCK, REVERSE_FIRST)
                x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf"),
                            eviction_policy=FIRST_EVICT).to(tl.float32)
                # a lane keeps the first column of its max: strict forward, not strict backward
                above = (x >= m_lane) if REVERSE_FIRST else (x > m_lane)
                e = _exp(-tl.abs(x - m_lane), EXP2)  # one exp per value: exp(m - x) if above, else exp(x - m)
                s_lane = tl.where(above, s_lane * e + 1.0, s_lane + e)
                i_lane = tl.where(above, cols, i_lane)
                m_lane = tl.maximum(m_lane, x)
            m = tl.max(m_lane, axis=0)
            lse = m + tl.log(tl.sum(s_lane * _exp(m_lane - m, EXP2), axis=0))
            best = tl.min(tl.where(m_lane == m, i_lane, n_cols), axis=0)  # first column holding the max
        else:
            m = tl.full([], -1.0e30, tl.float32)
            s = tl.zeros([], tl.float32)
            best = tl.zeros([], tl.int32)
            for tile in range(0, n_tiles):
                cols = _tile_cols(tile, n_tiles, BLOCK, REVERSE_FIRST)
                x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf"),
                            eviction_policy=FIRST_EVICT).to(tl.float32)
                tile_max = tl.max(x, axis=0)
                tile_best = tl.min(tl.where(x == tile_max, cols, n_cols), axis=0)
                new_m = tl.maximum(m, tile_max)
                s = s * _exp(m - new_m, EXP2) + tl.sum(_exp(x - new_m, EXP2), axis=0)
                # a tie goes to the earlier column: strict forward, not strict backward
                best = tl.where((tile_max >= m) if REVERSE_FIRST else (tile_max > m), tile_best, best)
                m = new_m
            lse = m + tl.log(s)
        tl.store(loss_ptr + row, (lse - x_label) * weight)
        tl.store(correct_ptr + row, (best == label).to(tl.int8))

        # pass 2: d loss / d logits = w * (softmax - onehot(label)), over the logits in place
        # REVERSE_SECOND: from the row's end, the tiles pass 1 read last, which L2 may still hold
        if COMPUTE_GRAD:
            for tile in range(0, n_tiles):
                cols = _tile_cols(tile, n_tiles, BLOCK, REVERSE_SECOND)
                in_row = cols < n_cols
                x = tl.load(row_ptr + cols, mask=in_row, other=0.0, eviction_policy=SECOND_EVICT).to(tl.float32)
                grad = (_exp(x - lse, EXP2) - tl.where(cols == label, 1.0, 0.0)) * weight
                tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


def weighted_ce_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    compute_grad: bool,
    loss_out: torch.Tensor | None = None,
    correct_out: torch.Tensor | None = None,
    **launch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [C, V] (rows contiguous), labels [C] in 0..V-1, weights [C] float32 ->
    (weighted loss per row [C] float32, argmax == label [C] bool); with compute_grad, logits is
    overwritten by the gradient of the summed weighted loss with respect to it. loss_out /
    correct_out ([C] float32 / [C] bool, contiguous) receive the results in place of new tensors.

    launch: keys of DEFAULT_LAUNCH for this call (block: columns per step; num_warps;
    programs_per_sm: programs walking the rows, None for one per row; lane_state; l2_hints: pass 1
    asks L2 to keep the row (evict_last), pass 2 lets it go (evict_first); reverse_first /
    reverse_second: pass 1 / pass 2 from the row's end; exp2: e**x as 2**(x log2 e); num_stages)."""
    unknown = set(launch) - set(DEFAULT_LAUNCH)
    if unknown:
        raise ValueError(f"unknown launch options {sorted(unknown)}; known: {sorted(DEFAULT_LAUNCH)}")
    c, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous")
    loss = torch.empty(c, dtype=torch.float32, device=logits.device) if loss_out is None else loss_out
    correct = torch.empty(c, dtype=torch.bool, device=logits.device) if correct_out is None else correct_out
    if c == 0:
        return loss, correct
    shape = {**DEFAULT_LAUNCH, **launch}
    block = min(shape["block"], triton.next_power_of_2(v))
    num_warps = min(shape["num_warps"], max(1, block // 256))  # at least 8 values a lane
    programs = c
    if shape["programs_per_sm"] and logits.is_cuda:
        programs = min(c, shape["programs_per_sm"] * _sm_count(logits.device))
    hints = shape["l2_hints"]
    _weighted_ce_rows_kernel[(programs,)](
        logits, logits.stride(0), labels.contiguous(), weights.float().contiguous(), loss, correct.view(torch.int8),
        c, v, COMPUTE_GRAD=compute_grad, BLOCK=block, LANE_STATE=shape["lane_state"],
        FIRST_EVICT="evict_last" if hints else "", SECOND_EVICT="evict_first" if hints else "",
        REVERSE_FIRST=shape["reverse_first"], REVERSE_SECOND=shape["reverse_second"], EXP2=shape["exp2"],
        num_warps=num_warps,
        **({"num_stages": shape["num_stages"]} if shape["num_stages"] else {}),
    )
    return loss, correct


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
