"""Storage encodings of hidden states: bf16 bits, fp8 e4m3 with a scale per token, or 4-bit codes.

Zarr has neither bfloat16, float8 nor 4-bit types, so the store keeps bit patterns in unsigned
integer arrays and records the storage dtype beside them (docs/store-format.md is the spec):

- ``bf16``: the bfloat16 value's 16 bits as uint16 [T, H]; lossless for bf16 states.
- ``fp8_e4m3``: per token t, ``scale[t] = amax_t / 448`` (448 = the largest finite e4m3fn value),
  and the bits of ``float8_e4m3fn(x / scale[t])`` as uint8 [T, H]; a value reads back as
  ``fp8 * scale[t]``.
- ``q4_hadamard``: each token's vector is rotated by a normalised Walsh-Hadamard transform (so the
  few massive-activation channels stop owning the scale), cut into groups of 16 values, and each
  value stored as a 4-bit index into a fixed 16-level codebook; a group's step is an e4m3 code
  times the token's float32 scale. uint8 [T, 9H/16] (two codes per byte, then one scale byte per
  group) and a float32 [T] scale: 0.28x the bytes of bf16 at H=4096 (0.29x at H=256). Below.

The dtype flow, one rule from disk to the GPU: a state array keeps its storage integer dtype
(uint16 for bf16, uint8 otherwise) from the store's files through the pinned cache, the
host-to-device copy and the device buffers (numpy arrays, then `torch.from_numpy` views of them,
then device tensors of the same dtype: `storage_torch_dtype`); only `decode_states`, on the device,
reinterprets the bits (`view` as bfloat16 or float8_e4m3fn, or the 4-bit unpacking) and makes
floating-point states. Scales are float32 throughout. Encoding mirrors it: `encode_states` runs
where the states are (the GPU, in precompute) and hands integer arrays to the device-to-host copy.

Encoding and decoding run where the data is, the GPU included: precompute encodes before the
device-to-host copy (fewer bytes to move), and the trainer decodes after the host-to-device copy.
Both are plain torch, except that on CUDA q4_hadamard decodes with one Triton kernel
(store/q4_triton.py: the packed row in, the states out, no float32 temporaries; `decode_states`'s
`backend`). The functions accept CPU numpy arrays as well (zero-copy through ``torch.from_numpy``).

fp8 round-trip bound (asserted by tests/dflash_common/store/test_quant.py): with s = amax_t / 448,
every element obeys ``|decoded - x| <= 2**-4 * |x| + 2**-10 * s``. The first term is half an e4m3
ulp for normal values (3 mantissa bits: the gap in [2^e, 2^(e+1)) is 2^(e-3)); the second is half
the subnormal step (2^-9 in scaled units) for values below 2^-6 * s.

q4_hadamard, exactly (H a multiple of 16; B = the largest power of two dividing H, e.g.
4096 -> 4096, 5120 -> 1024, 3584 -> 512):
1. y = R x: each block of B consecutive values is multiplied by the Sylvester Hadamard matrix
   (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]) divided by sqrt(B). R is orthonormal and its own
   inverse, so errors keep their size through it.
2. Groups g of 16 consecutive values of y; a_g = max |y_i| over the group; L = 0.9815 (the largest
   level); the token scale S = max_g a_g / (448 L), float32.
3. A group's scale byte c is an e4m3 code: of the smallest code whose value is >= a_g / (L S) (no
   value leaves the codebook's range) and the code just below it, the one whose reconstruction has
   the smaller squared error (ties: the larger). The group's step is d = e4m3(c) * S.
4. Each value's code is the index of the level nearest y_i / d (ties: the lower index).
5. Decoding: y_i = LEVELS[code_i] * d, then x = R y.
Bound (asserted by the tests): for every group, ||decoded_y - y||_2 <= sqrt(16) * (G/2) * d_up
with G = 0.1825 the largest gap between adjacent levels and d_up = (1 + 2^-3) a_g / L + 2^-9 S,
the step of the no-clip code (e4m3's relative step is at most 2^-3 for normal codes, 2^-9
absolute below them). On normal vectors the relative L2 error is ~0.072 (fp8_e4m3: ~0.026);
benchmarks/store_codecs.py measures it on a target's states.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Literal

import numpy as np
import torch

StorageDtype = Literal["bf16", "fp8_e4m3", "q4_hadamard"]
DecodeBackend = Literal["auto", "triton", "torch"]
STORAGE_DTYPES: tuple[str, ...] = ("bf16", "fp8_e4m3", "q4_hadamard")
SCALED_DTYPES: tuple[str, ...] = ("fp8_e4m3", "q4_hadamard")  # with a float32 scale per token

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value: amax maps here, so nothing saturates
FP8_REL_ERROR = 2.0**-4  # half an ulp relative to the value, 3 mantissa bits
FP8_ABS_ERROR = 2.0**-10  # half the subnormal step (2^-9), in units of the token's scale

# Lloyd-Max levels of a group of 16 standard normal values divided by the group's largest magnitude
# (fitted on 4M groups): the rotated states are close to normal, and a group's scale comes from its
# largest value. Beat NF4's levels by 4-12% and FP4 e2m1's by 20-27% in relative L2 error
# (docs/benchmarks.md, "Storage codecs").
Q4_POSITIVE = (0.0529, 0.1597, 0.2696, 0.3849, 0.5085, 0.6446, 0.7990, 0.9815)
Q4_LEVELS: tuple[float, ...] = tuple(-v for v in reversed(Q4_POSITIVE)) + Q4_POSITIVE  # code 0..15
Q4_GROUP = 16  # values per scale byte: 1/16 byte of scale per value keeps a row at 9/16 of H bytes
# 0.1825: twice the worst rounding error, in steps
Q4_LARGEST_GAP = Q4_POSITIVE[-1] - Q4_POSITIVE[-2]
_Q4_ROWS = 1 << 24  # elements per slice of rows encoded or decoded at once: bounds the temporaries

# Bits of the stored payload, per storage dtype (zarr data type names).
_STORAGE_TORCH = {"bf16": torch.uint16, "fp8_e4m3": torch.uint8, "q4_hadamard": torch.uint8}
_STORAGE_NUMPY = {k: np.dtype(str(v).removeprefix("torch.")) for k, v in _STORAGE_TORCH.items()}
_LOGICAL = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
# the `logical_dtype` attribute of a stored state array
LOGICAL_DTYPE_NAMES = {
    "bf16": "bfloat16",
    "fp8_e4m3": "float8_e4m3fn",
    "q4_hadamard": "q4_hadamard",
}

_BF16_EXPONENT = 0x7F80  # exponent bits all ones: Inf or NaN
_FP8_NAN = 0x7F  # e4m3fn has no Inf; S.1111.111 is its only NaN (either sign)
# NaN scan in blocks that stay in the L2 cache: ~4x faster than whole arrays
_CHECK_BLOCK_BYTES = 1 << 19


@dataclasses.dataclass(frozen=True)
class EncodedStates:
    """One layer's states of T tokens as stored: `data` [T, row] in the storage integer dtype (row:
    `row_size`), `scale` [T] float32 for the scaled dtypes (None for bf16). Tensors or numpy arrays,
    on any device."""

    dtype: str
    data: torch.Tensor | np.ndarray
    scale: torch.Tensor | np.ndarray | None = None


def check_storage_dtype(dtype: str) -> None:
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype {dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")


def check_hidden_size(dtype: str, hidden: int) -> None:
    """q4_hadamard needs whole groups: a ValueError naming the fix for another hidden size."""
    check_storage_dtype(dtype)
    if dtype == "q4_hadamard" and hidden % Q4_GROUP:
        raise ValueError(
            f"storage dtype q4_hadamard needs a hidden size that is a multiple of "
            f"{Q4_GROUP}, not {hidden}; choose bf16 or fp8_e4m3"
        )


def storage_numpy_dtype(dtype: str) -> np.dtype:
    """The integer dtype that holds the bits of `dtype` (uint16 for bf16, uint8 for the others)."""
    check_storage_dtype(dtype)
    return _STORAGE_NUMPY[dtype]


def row_size(dtype: str, hidden: int) -> int:
    """Elements of the stored row of one token's state: H, or 9H/16 bytes for q4_hadamard (H/2 code
    bytes, then H/16 group scale bytes)."""
    check_hidden_size(dtype, hidden)
    return hidden // 2 + hidden // Q4_GROUP if dtype == "q4_hadamard" else hidden


def storage_torch_dtype(dtype: str) -> torch.dtype:
    """The torch twin of `storage_numpy_dtype`: what stored bits are while they travel."""
    check_storage_dtype(dtype)
    return _STORAGE_TORCH[dtype]


def has_scale(dtype: str) -> bool:
    """Whether states of this dtype come with a float32 scale per token (array `<layer>_scale`)."""
    check_storage_dtype(dtype)
    return dtype in SCALED_DTYPES


def token_bytes(dtype: str, hidden: int) -> int:
    """Stored bytes of one token's state in one layer: the row and its scale."""
    return row_size(dtype, hidden) * storage_numpy_dtype(dtype).itemsize + (
        4 if has_scale(dtype) else 0
    )


def token_bytes_formula(dtype: str, hidden: int) -> str:
    """`token_bytes` as a sum a reader can check: '2 x 4096', '(4096 + 4)', '(2304 + 4)'."""
    if not has_scale(dtype):
        return f"2 x {hidden}"
    return f"({row_size(dtype, hidden)} + 4)"


def encode_states(states: torch.Tensor, dtype: str) -> EncodedStates:
    """[T, H] states (any float dtype, any device) -> their storage encoding on the same device."""
    check_storage_dtype(dtype)
    if states.dim() != 2:
        raise ValueError(f"states must be [T, H], got shape {tuple(states.shape)}")
    if dtype == "bf16":
        return EncodedStates("bf16", states.to(torch.bfloat16).contiguous().view(torch.uint16))
    if dtype == "q4_hadamard":
        return _q4_encode(states)
    x = states.float()
    amax = x.abs().amax(dim=1)  # [T]; Inf/NaN in a row make the scale non-finite
    # A tensor divisor, not the Python number: CUDA divides by a scalar as a multiplication by its
    # rounded reciprocal, a last-bit difference that changes codes; tensor division is exact on
    # both.
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    # clamp: x / (amax / 448) can round a hair above 448, and casts need not saturate on every
    # device
    scaled = (x / safe[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    bits = scaled.to(torch.float8_e4m3fn).view(torch.uint8)  # [T, H]
    return EncodedStates("fp8_e4m3", bits, scale)


def _as_tensor(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))


def decode_states(
    data: torch.Tensor | np.ndarray,
    scale: torch.Tensor | np.ndarray | None,
    dtype: str,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: DecodeBackend = "auto",
) -> torch.Tensor:
    """Stored bits [T, row] (+ scale [T]) -> states [T, H] in `out_dtype`, on data's device.

    `backend` decodes q4_hadamard with the Triton kernel (store/q4_triton.py: one pass, what the
    trainer runs on a GPU) or with torch; "auto" takes Triton on CUDA where the hidden size allows
    it and its first decode there agrees with torch's (`_kernel_agrees`), torch elsewhere (the
    tests run the kernel on a CPU under TRITON_INTERPRET=1)."""
    check_storage_dtype(dtype)
    bits = _as_tensor(data)
    if bits.dtype != _STORAGE_TORCH[dtype]:
        raise ValueError(f"{dtype} states are stored as {_STORAGE_TORCH[dtype]}, got {bits.dtype}")
    if dtype == "bf16":
        return bits.view(torch.bfloat16).to(out_dtype)
    if scale is None:
        raise ValueError(f"{dtype} states need their per-token scale to decode")
    s = _as_tensor(scale).to(device=bits.device, dtype=torch.float32)
    if dtype == "q4_hadamard":
        return _q4_decode(bits, s, out_dtype, backend)
    return (bits.view(torch.float8_e4m3fn).float() * s[:, None]).to(out_dtype)


# -- q4_hadamard ---------------------------------------------------------------------------------


def hadamard_block(hidden: int) -> int:
    """The rotation's block: the largest power of two dividing H (4096 -> 4096, 5120 -> 1024)."""
    return hidden & -hidden


def hadamard_split(hidden: int) -> tuple[int, int]:
    """(a, b): the decoder's factors of the block, B = a * b, a = 2^floor(log2(B) / 2)."""
    block = hadamard_block(hidden)
    a = 1 << (block.bit_length() - 1) // 2
    return a, block // a


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [N, H] float32 -> R x: the normalised Walsh-Hadamard transform of every block of
    `hadamard_block(H)` values, by butterflies. Additions and subtractions only, in one fixed order,
    so CPU and GPU give the same bits (the encoder's codes must not depend on the device)."""
    n, h = x.shape
    block = hadamard_block(h)
    y = x.reshape(-1, block)  # [N*H/B, B]
    buffers, k, half = (torch.empty_like(y), torch.empty_like(y)), 0, 1
    while half < block:  # two buffers in turn: a stage reads one and writes the other
        pairs = y.view(-1, block // (2 * half), 2, half)  # elements `half` apart form the pairs
        out = buffers[k].view(pairs.shape)
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 1])
        y, k, half = buffers[k], 1 - k, 2 * half
    return y.reshape(n, h) * block**-0.5


def hadamard_by_matmul(x: torch.Tensor) -> torch.Tensor:
    """The same transform as `hadamard` up to rounding, as two small matrix products: a block of
    B = a * b values is an [a, b] matrix X, and H_B x = H_a X H_b (H_B = H_a (x) H_b). Two passes
    over the data instead of log2(B): the torch decoder's choice (several times faster,
    docs/benchmarks.md)."""
    n, h = x.shape
    a, b = hadamard_split(h)
    ha, hb = _sylvester(a, x.device), _sylvester(b, x.device)
    y = torch.matmul(ha, x.reshape(-1, a, b))  # [N*H/B, a, b]
    return torch.matmul(y, hb).view(n, h)


@functools.lru_cache(maxsize=None)
def _sylvester(n: int, device: torch.device) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix [n, n] (n a power of two), float32 on `device`."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while len(h) < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).float().to(device)


@functools.lru_cache(maxsize=None)
def _q4_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """levels [16], the midpoints between neighbours [15] (float32), and every byte's two decoded
    codes [256, 2] (low nibble first), on `device`."""
    levels = torch.tensor(Q4_LEVELS, dtype=torch.float32)
    mids = (levels[1:] + levels[:-1]) / 2
    byte = torch.arange(256)
    pairs = torch.stack((levels[byte & 0xF], levels[byte >> 4]), dim=1)
    return levels.to(device), mids.to(device), pairs.to(device)


def _row_slices(t: int, hidden: int):
    rows = max(1, _Q4_ROWS // hidden)
    return (slice(start, min(start + rows, t)) for start in range(0, t, rows))


def _q4_encode(states: torch.Tensor) -> EncodedStates:
    """[T, H] -> uint8 [T, 9H/16] (codes, then group scale bytes) and float32 [T] token scales."""
    t, h = states.shape
    check_hidden_size("q4_hadamard", h)
    data = torch.empty(t, row_size("q4_hadamard", h), dtype=torch.uint8, device=states.device)
    scale = torch.empty(t, dtype=torch.float32, device=states.device)
    for rows in _row_slices(t, h):
        data[rows], scale[rows] = _q4_encode_rows(states[rows].float())
    return EncodedStates("q4_hadamard", data, scale)


def _q4_encode_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t, h = x.shape
    groups = hadamard(x).view(t, h // Q4_GROUP, Q4_GROUP)  # [T, n, 16], rotated
    amax = groups.abs().amax(dim=2)  # [T, n]
    top = Q4_POSITIVE[-1] * FP8_E4M3_MAX
    scale = amax.amax(dim=1) / torch.full_like(amax[:, 0], top)  # [T]; tensor divisor: see fp8
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    ratio = (amax / (safe * Q4_POSITIVE[-1])[:, None]).clamp_(max=FP8_E4M3_MAX)  # [T, n], <= 448
    up = _e4m3_code_at_least(ratio)  # no value of the group leaves the codebook's range
    down = (up.int() - 1).clamp_(min=0).to(torch.uint8)
    codes_up, err_up = _q4_quantise(groups, up, safe)
    codes_down, err_down = _q4_quantise(groups, down, safe)
    lower = err_down < err_up  # [T, n]
    group_scale = torch.where(lower, down, up)
    codes = torch.where(lower[..., None], codes_down, codes_up).view(t, h // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)  # [T, H/2], the even value in the low nibble
    return torch.cat((packed, group_scale), dim=1), scale


def _e4m3_code_at_least(r: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes of the smallest e4m3 values >= r (r in [0, 448]; positive codes are
    ordered)."""
    code = r.to(torch.float8_e4m3fn).view(torch.uint8)  # nearest, maybe below r
    return code + (code.view(torch.float8_e4m3fn).float() < r).to(torch.uint8)


def _q4_quantise(groups: torch.Tensor, code: torch.Tensor, scale: torch.Tensor):
    """Nearest levels for the group scale codes `code` [T, n] -> (uint8 codes [T, n, 16], squared
    error [T, n]). Elementwise steps and a fixed summation tree: the same bits on every device."""
    levels, mids, _ = _q4_tables(groups.device)
    step = code.view(torch.float8_e4m3fn).float() * scale[:, None]  # [T, n]
    divisor = torch.where(step > 0, step, torch.full_like(step, math.inf))  # step 0: every code 7
    idx = torch.bucketize(groups / divisor[..., None], mids, out_int32=True)  # [T, n, 16]
    err = (levels[idx] * step[..., None] - groups).square()
    while err.shape[-1] > 1:  # pairwise sums in a fixed order (a reduction's order is the device's)
        half = err.shape[-1] // 2
        err = err[..., :half] + err[..., half:]
    return idx.to(torch.uint8), err[..., 0]


def _q4_decode(
    bits: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, backend: DecodeBackend
) -> torch.Tensor:
    t, row = bits.shape
    h = row * Q4_GROUP // (Q4_GROUP // 2 + 1)  # row = H/2 + H/16
    if bits.dim() != 2 or row_size("q4_hadamard", h) != row or scale.shape != (t,):
        raise ValueError(
            f"q4_hadamard rows of {row} bytes with {tuple(scale.shape)} scales do not "
            f"decode to [T, H] (rows of 9H/16 bytes, one scale per row)"
        )
    out = torch.empty(t, h, dtype=out_dtype, device=bits.device)
    use = _q4_backend(backend, bits.device, h)
    if use == "triton":
        from dflash_common.store import q4_triton

        levels, _, _ = _q4_tables(bits.device)
        q4_triton.q4_decode(bits, scale, hadamard_split(h), levels, out)
        if backend != "auto" or _kernel_agrees(bits, scale, out):
            return out
    _, _, pairs = _q4_tables(bits.device)
    for rows in _row_slices(t, h):
        n = rows.stop - rows.start
        values = pairs[bits[rows, : h // 2].int()].view(n, h // Q4_GROUP, Q4_GROUP)  # [n, H/16, 16]
        # [n, H/16]
        step = bits[rows, h // 2 :].view(torch.float8_e4m3fn).float() * scale[rows, None]
        out[rows] = hadamard_by_matmul((values * step[..., None]).view(n, h))
    return out


def _q4_backend(backend: DecodeBackend, device: torch.device, hidden: int) -> str:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"decode backend {backend!r} unknown; use 'auto', 'triton' or 'torch'")
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "torch"
    try:
        from dflash_common.store import q4_triton
    except ImportError:  # no Triton: torch decodes
        return "torch"
    if min(hadamard_split(hidden)) < q4_triton.MIN_SIDE:
        return "torch"
    return _CHECKED.get((str(device), hidden), "triton")


# (device, H) -> the decoder "auto" takes there, once the kernel's first decode was checked
_CHECKED: dict[tuple[str, int], str] = {}
_CHECK_ROWS = 64
_CHECK_TOLERANCE = 1e-5  # of the row's largest value: float32 products in three tf32 passes


def _kernel_agrees(bits: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the Triton kernel's first decode of this hidden size on this device (`out`, from
    `bits`) agrees with the torch decoder on its first 64 rows, to 1e-5 of a row's largest value
    plus, for a bf16 `out`, its rounding (2^-8 of the value). Checked once per (device, H); where
    it disagrees "auto" decodes with torch from then on and warns: a kernel is compiled for each GPU
    and Triton version, and a wrong one must not train a drafter silently."""
    key = (str(out.device), out.shape[1])
    if key in _CHECKED or len(out) == 0:
        return _CHECKED.get(key, "triton") == "triton"
    want = _q4_decode(bits[:_CHECK_ROWS], scale[:_CHECK_ROWS], torch.float32, "torch")
    err = (out[:_CHECK_ROWS].float() - want).abs()
    if out.dtype == torch.bfloat16:
        err = (err - 2**-8 * want.abs()).clamp_min(0)
    err = (err / want.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)).nan_to_num()
    worst = float(err.max())
    _CHECKED[key] = "triton" if worst <= _CHECK_TOLERANCE else "torch"
    if _CHECKED[key] == "torch":
        warnings.warn(
            f"the Triton q4_hadamard decoder disagrees with the torch decoder on {out.device} "
            f"(H={key[1]}: an error of {worst:.2g} of a row's largest value, above "
            f"{_CHECK_TOLERANCE:g}); states of this size are decoded with torch here instead "
            "(correct, slower): report it with your GPU and Triton version",
            stacklevel=4,
        )
    return _CHECKED[key] == "triton"


# -- NaN / Inf -------------------------------------------------------------------------------------


def nonfinite_rows(data: np.ndarray, scale: np.ndarray | None, dtype: str) -> np.ndarray:
    """Row (token) indices whose encoded states hold NaN or Inf, judged from the stored bits alone:
    bf16 and fp8 values, q4_hadamard's group scale bytes, and the token scales."""
    check_storage_dtype(dtype)
    # every 4-bit code is a finite level: only the scale bytes can be NaN
    if dtype == "q4_hadamard":
        data = data[:, data.shape[1] * 8 // 9 :]
    rows = max(1, _CHECK_BLOCK_BYTES // max(1, data[:1].nbytes))
    bad = [
        start + _bad_rows(data[start : start + rows], dtype)
        for start in range(0, len(data), rows)
        if _block_has_nonfinite(data[start : start + rows], dtype)
    ]
    if has_scale(dtype) and scale is not None:
        bad.append(np.flatnonzero(~np.isfinite(scale)))
    return np.unique(np.concatenate(bad)) if bad else np.zeros(0, dtype=np.int64)


def _block_has_nonfinite(block: np.ndarray, dtype: str) -> bool:
    """One fast reduction per block: Inf/NaN are the largest magnitudes once the sign is masked off
    (bf16: |bits| >= 0x7F80), and the fp8 NaN is the only code whose low 7 bits are all ones."""
    if dtype == "bf16":
        return int((block & 0x7FFF).max()) >= _BF16_EXPONENT
    return int((block | 0x80).max()) == 0xFF


def _bad_rows(block: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return np.flatnonzero(((block & _BF16_EXPONENT) == _BF16_EXPONENT).any(axis=1))
    return np.flatnonzero(((block & 0x7F) == _FP8_NAN).any(axis=1))
