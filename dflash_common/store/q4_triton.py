"""q4_hadamard decoding as one Triton kernel: codes -> levels -> group steps -> inverse rotation.

The torch decoder (quant.py `_q4_decode`) makes five passes over [T, H] float32 temporaries (the
code bytes as int32, the two levels per byte, the scaled values, then the two matrix products of
`hadamard_by_matmul`) and converts the result to the output dtype. Here one program takes the
Hadamard block of B = a * b values of a few tokens (as many as the autotuner finds fastest on the
GPU): it loads each block's B/2 code bytes and B/16 group scale bytes, builds the scaled values as
[a, b] matrices X in registers, multiplies all their rows by H_b in one product and each token's
by H_a, and writes R X = H_a X H_b / sqrt(B) once, in the output dtype: the bytes read are the
packed rows, the bytes written are the states, and nothing else crosses memory. The trainer
decodes every batch read from a 4-bit store after its host-to-device copy, so this is the part of a
step that a store of decoded states would not pay.

Exactness: the Sylvester matrices are built in the kernel as +-1 (H[i, j] = (-1)^popcount(i & j)),
exact in any precision, and the 1/sqrt(B) is applied once, in float32, after both products. The
products take float32 operands in three tensor-core passes (`tf32x3`), which keeps float32's
precision to within a few units of its last place (the tests compare against the torch decoder).

Shapes: a and b are powers of two (B = the largest power of two dividing H, a = 2^floor(log2(B)/2),
b = B / a: quant.hadamard_split) and `tl.dot` needs both >= 16 (`MIN_SIDE`), so B >= 256;
quant.py decodes the others with torch.

Runs on the CPU under TRITON_INTERPRET=1 (the test suite does so).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MIN_SIDE = 16  # tl.dot's smallest matrix side: blocks of a, b >= 16 (quant.py decodes others)


@functools.lru_cache(maxsize=None)
def _e4m3_values(device: torch.device) -> torch.Tensor:
    """The value of every e4m3 byte [256], float32 on `device` (a group scale byte's step)."""
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return e4m3.to(device)


@triton.jit
def _signs(n: tl.constexpr):
    """The +-1 Sylvester Hadamard matrix [n, n] (n <= 128): (-1)^popcount(i & j)."""
    i = tl.arange(0, n)
    v = i[:, None] & i[None, :]
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return 1.0 - 2.0 * (v & 1).to(tl.float32)


@triton.jit
def _q4_decode_kernel(
    bits_ptr,
    scale_ptr,
    levels_ptr,
    e4m3_ptr,
    out_ptr,
    tokens,
    stride_bits,
    stride_out,
    half,  # H / 2: where a row's group scale bytes start
    norm,  # 1 / sqrt(B)
    A: tl.constexpr,
    B: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    TOKENS: tl.constexpr,  # tokens per program (the autotuner's choice)
):
    # rows [TOKENS * A] of the program's [A, B] matrices, token after token
    rows = tl.arange(0, TOKENS * A)
    token = tl.program_id(0).to(tl.int64) * TOKENS + rows // A
    ok = (token < tokens)[:, None]
    # the row's first value within the token's state: block, then row of the block
    first = tl.program_id(1) * (A * B) + (rows % A) * B
    src = bits_ptr + token[:, None] * stride_bits
    # B/2 code bytes a row, the even value in the low nibble: [R, B/2] -> [R, B/2, 2] -> [R, B]
    byte = tl.load(src + first[:, None] // 2 + tl.arange(0, B // 2)[None, :], mask=ok, other=0)
    byte = byte.to(tl.int32)
    code = tl.reshape(tl.join(byte & 0xF, byte >> 4), (TOKENS * A, B))
    # B/16 group scale bytes a row: the step of each group of 16 values
    group = tl.load(
        src + half + first[:, None] // 16 + tl.arange(0, B // 16)[None, :], mask=ok, other=0
    )
    scale = tl.load(scale_ptr + token, mask=token < tokens, other=0.0)
    step = tl.load(e4m3_ptr + group.to(tl.int32)) * scale[:, None]  # [R, B/16]
    x = tl.reshape(tl.load(levels_ptr + code), (TOKENS * A, B // 16, 16)) * step[:, :, None]
    # R X = H_a X H_b / sqrt(B): X H_b for all rows at once, then H_a X' per token
    y = tl.dot(tl.reshape(x, (TOKENS * A, B)), _signs(B), input_precision="tf32x3")
    ha = tl.broadcast_to(_signs(A)[None, :, :], (TOKENS, A, A))
    y = tl.dot(ha, tl.reshape(y, (TOKENS, A, B)), input_precision="tf32x3")
    y = tl.reshape(y, (TOKENS * A, B)) * norm
    if ROUND_BF16:  # round to nearest even by hand: the interpreter's cast truncates
        u = y.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        y = u.to(tl.float32, bitcast=True)  # now exact in bfloat16
    dst = out_ptr + token[:, None] * stride_out + first[:, None] + tl.arange(0, B)[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=ok)


# Tokens per program and warps, chosen by timing on the first decode of each shape (a GPU only: the
# interpreter runs the kernel with one token per program)
_q4_decode_tuned = triton.autotune(
    configs=[
        triton.Config({"TOKENS": t}, num_warps=w)
        for t, w in ((1, 4), (1, 8), (2, 8), (4, 8), (8, 8))
    ],
    key=["A", "B", "ROUND_BF16"],
)(_q4_decode_kernel)


def q4_decode(
    bits: torch.Tensor,
    scale: torch.Tensor,
    split: tuple[int, int],
    levels: torch.Tensor,
    out: torch.Tensor,
    tokens_per_program: int | None = None,
) -> torch.Tensor:
    """uint8 [T, 9H/16] codes and float32 [T] scales -> `out` [T, H] (rows may be strided, e.g. one
    layer's columns of a batch's features), decoded as quant.py specifies; `split` = (a, b), the
    block's factors (quant.hadamard_split), `levels` the 16 levels, float32 on the device.
    `tokens_per_program` (a power of two) fixes what the autotuner otherwise picks on a GPU (1
    under the interpreter)."""
    t, hidden = out.shape
    a, b = split
    if min(a, b) < MIN_SIDE:
        raise ValueError(f"the Triton q4 decoder takes Hadamard blocks of at least "
                         f"{MIN_SIDE} x {MIN_SIDE}, not {a} x {b} (H={hidden}): decode it with "
                         f"backend='torch'")  # fmt: skip
    if bits.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("the Triton q4 decoder needs rows whose bytes and values are contiguous")
    if t == 0:
        return out
    e4m3 = _e4m3_values(bits.device)
    args = (bits, scale.contiguous(), levels, e4m3, out, t, bits.stride(0), out.stride(0))
    shape = dict(A=a, B=b, ROUND_BF16=out.dtype == torch.bfloat16)
    blocks = hidden // (a * b)
    if bits.device.type == "cuda" and tokens_per_program is None:
        grid = lambda meta: (triton.cdiv(t, meta["TOKENS"]), blocks)  # noqa: E731
        _q4_decode_tuned[grid](*args, hidden // 2, (a * b) ** -0.5, **shape)
    else:  # fixed, or TRITON_INTERPRET=1
        n = tokens_per_program or 1
        grid = (triton.cdiv(t, n), blocks)
        _q4_decode_kernel[grid](*args, hidden // 2, (a * b) ** -0.5, **shape, TOKENS=n)
    return out
