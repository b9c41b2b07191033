"""DFlash2's grouped dynamic convolution as Triton kernels, forward and backward.

For x [R, H] (rows of consecutive blocks of `block` rows), delta [R, T, G] and base [T, H], with the
block position p(i) = i mod block and the group g(c) = c // group_size (dflash2.py `grouped_conv`):

    out[i, c] = sum_t [p(i) >= t] (base[t, c] + delta[i, t, g(c)]) x[i - t, c]

Backward, with dout [R, H] and prod_t[i, c] = [p(i) >= t] dout[i, c] x[i - t, c]:

    dx[i, c]        = sum_t [p(i) + t < block] (base[t, c] + delta[i + t, t, g(c)]) dout[i + t, c]
    ddelta[i, t, g] = sum over the group's channels c of prod_t[i, c]
    dbase[t, c]     = sum over rows i of prod_t[i, c]

One program takes a tile of rows x channels (whole groups); every load is a coalesced row segment,
the shifted rows (i - t, i + t) come from the same tile's neighbourhood, and everything accumulates
in float32 with one rounding at the store (as vLLM's serving kernel). dbase is reduced per row tile
into float32 partials [row tiles, T, H], summed by torch (deterministic, no atomics). Memory
traffic: the forward reads x and delta once per tap and writes out once; the backward reads dout, x
and delta once per tap and writes dx, ddelta and the partials once, no [R, T, H] coefficient tensor
is ever built (the torch version builds one per tap).

The group reduction reshapes a tile to [rows, groups, group_size]: group_size must be a power of two
(`supported` says whether this kernel takes a shape; dflash2.py falls back to torch otherwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_R = 32  # rows per program
_BLOCK_C = 128  # channels per program (whole groups)


def supported(group_size: int) -> bool:
    """Whether the kernels take this group size: a power of two."""
    return group_size >= 1 and group_size & (group_size - 1) == 0


def _block_c(hidden: int, group_size: int) -> int:
    return max(group_size, min(_BLOCK_C, triton.next_power_of_2(hidden)))


@triton.jit
def _conv_forward_kernel(
    x_ptr,
    delta_ptr,
    base_ptr,
    out_ptr,
    rows_total,
    hidden,
    block,
    stride_x,
    stride_delta_row,
    stride_delta_tap,
    stride_out,
    GROUP: tl.constexpr,
    TAPS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < rows_total, cols < hidden
    position = rows % block
    groups = cols // GROUP
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for tap in tl.static_range(TAPS):
        ok = (row_ok & (position >= tap))[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + (rows - tap)[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
        d = tl.load(
            delta_ptr + rows[:, None] * stride_delta_row + tap * stride_delta_tap + groups[None, :],
            mask=ok,
            other=0.0,
        )
        b = tl.load(base_ptr + tap * hidden + cols, mask=col_ok, other=0.0)
        acc += (b.to(tl.float32)[None, :] + d.to(tl.float32)) * x.to(tl.float32)
    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_out + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=ok,
    )


@triton.jit
def _conv_backward_kernel(
    dout_ptr,
    x_ptr,
    delta_ptr,
    base_ptr,
    dx_ptr,
    ddelta_ptr,
    dbase_ptr,
    rows_total,
    hidden,
    block,
    stride_dout,
    stride_x,
    stride_delta_row,
    stride_delta_tap,
    stride_dx,
    GROUP: tl.constexpr,
    TAPS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < rows_total, cols < hidden
    position = rows % block
    groups = cols // GROUP
    num_groups = hidden // GROUP
    group_cols = pid_c * (BLOCK_C // GROUP) + tl.arange(0, BLOCK_C // GROUP)
    here = row_ok[:, None] & col_ok[None, :]
    dout = tl.load(dout_ptr + rows[:, None] * stride_dout + cols[None, :], mask=here, other=0.0).to(
        tl.float32
    )
    dx = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for tap in tl.static_range(TAPS):
        # dx: row i feeds row i + tap of its own block with that row's tap-`tap` coefficient
        later = rows + tap
        ok = (row_ok & (position + tap < block) & (later < rows_total))[:, None] & col_ok[None, :]
        d_later = tl.load(
            delta_ptr
            + later[:, None] * stride_delta_row
            + tap * stride_delta_tap
            + groups[None, :],
            mask=ok,
            other=0.0,
        ).to(tl.float32)
        b = tl.load(base_ptr + tap * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)
        dout_later = tl.load(
            dout_ptr + later[:, None] * stride_dout + cols[None, :], mask=ok, other=0.0
        )
        dx += (b[None, :] + d_later) * dout_later.to(tl.float32)  # masked rows load zeros
        # the coefficient's gradients: dout at row i times the row it read, tap rows back
        ok = (row_ok & (position >= tap))[:, None] & col_ok[None, :]
        x = tl.load(
            x_ptr + (rows - tap)[:, None] * stride_x + cols[None, :], mask=ok, other=0.0
        ).to(tl.float32)
        prod = dout * x  # [BLOCK_R, BLOCK_C]; zero where the tap reaches before the block
        tl.store(
            dbase_ptr + (pid_r * TAPS + tap) * hidden + cols, tl.sum(prod, axis=0), mask=col_ok
        )
        by_group = tl.sum(tl.reshape(prod, (BLOCK_R, BLOCK_C // GROUP, GROUP)), axis=2)
        g_ok = row_ok[:, None] & (group_cols < num_groups)[None, :]
        tl.store(
            ddelta_ptr + (rows[:, None] * TAPS + tap) * num_groups + group_cols[None, :],
            by_group,
            mask=g_ok,
        )
    tl.store(
        dx_ptr + rows[:, None] * stride_dx + cols[None, :],
        dx.to(dx_ptr.dtype.element_ty),
        mask=here,
    )


def _rows_last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def conv_forward(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block: int, group_size: int
) -> torch.Tensor:
    """out [R, H] in x's dtype; delta may be a strided view (one side of the [R, 2, T, G]
    projection output)."""
    rows, hidden = x.shape
    taps = base.shape[0]
    x, delta, base = _rows_last_contiguous(x), _rows_last_contiguous(delta), base.contiguous()
    out = torch.empty_like(x)
    if rows == 0:
        return out
    block_c = _block_c(hidden, group_size)
    grid = (triton.cdiv(rows, _BLOCK_R), triton.cdiv(hidden, block_c))
    _conv_forward_kernel[grid](
        x,
        delta,
        base,
        out,
        rows,
        hidden,
        block,
        x.stride(0),
        delta.stride(0),
        delta.stride(1),
        out.stride(0),
        GROUP=group_size,
        TAPS=taps,
        BLOCK_R=_BLOCK_R,
        BLOCK_C=block_c,
    )
    return out


def conv_backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    base: torch.Tensor,
    block: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [R, H] in x's dtype, ddelta [R, T, G] float32, dbase [T, H] float32)."""
    rows, hidden = x.shape
    taps, groups = base.shape[0], hidden // group_size
    dout, x = _rows_last_contiguous(dout), _rows_last_contiguous(x)
    delta, base = _rows_last_contiguous(delta), base.contiguous()
    dx = torch.empty_like(x)
    ddelta = torch.empty(rows, taps, groups, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(rows, _BLOCK_R)
    partial = torch.empty(tiles, taps, hidden, dtype=torch.float32, device=x.device)
    if rows == 0:
        return dx, ddelta, partial.new_zeros(taps, hidden)
    block_c = _block_c(hidden, group_size)
    _conv_backward_kernel[(tiles, triton.cdiv(hidden, block_c))](
        dout,
        x,
        delta,
        base,
        dx,
        ddelta,
        partial,
        rows,
        hidden,
        block,
        dout.stride(0),
        x.stride(0),
        delta.stride(0),
        delta.stride(1),
        dx.stride(0),
        GROUP=group_size,
        TAPS=taps,
        BLOCK_R=_BLOCK_R,
        BLOCK_C=block_c,
    )
    return dx, ddelta, partial.sum(0)


class GroupedConvFunction(torch.autograd.Function):
    """The convolution with the Triton kernels both ways (gradients to x, delta and base)."""

    @staticmethod
    def forward(ctx, x, delta, base, block: int, group_size: int):
        ctx.save_for_backward(x, delta, base)
        ctx.block, ctx.group_size = block, group_size
        return conv_forward(x, delta, base, block, group_size)

    @staticmethod
    def backward(ctx, dout):
        x, delta, base = ctx.saved_tensors
        dx, ddelta, dbase = conv_backward(dout, x, delta, base, ctx.block, ctx.group_size)
        return dx, ddelta.to(delta.dtype), dbase.to(base.dtype), None, None
