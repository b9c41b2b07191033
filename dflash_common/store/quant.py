"""Storage encodings of hidden states: bf16 bit patterns, or fp8 e4m3 with a float32 scale per token.

Zarr has neither bfloat16 nor float8, so the store keeps their bit patterns in unsigned integer arrays
and records the logical dtype beside them (docs/store-format.md):

- ``bf16``: the bfloat16 value's 16 bits as uint16; lossless for bf16 states.
- ``fp8_e4m3``: per token t, ``scale[t] = amax_t / 448`` (448 = the largest finite e4m3fn value), and
  the bits of ``float8_e4m3fn(x / scale[t])`` as uint8; a value reads back as ``fp8 * scale[t]``.

Encoding and decoding are plain torch, so they run on the GPU: precompute encodes before the
device-to-host copy (fp8 halves the bytes moved), and the trainer decodes after the host-to-device
copy. The functions accept CPU numpy arrays as well (zero-copy through ``torch.from_numpy``).

fp8 round-trip bound (asserted by tests/dflash_common/store/test_quant.py): with s = amax_t / 448, every
element obeys ``|decoded - x| <= 2**-4 * |x| + 2**-10 * s``. The first term is half an e4m3 ulp for
normal values (3 mantissa bits: the gap in [2^e, 2^(e+1)) is 2^(e-3)); the second is half the
subnormal step (2^-9 in scaled units) for values below 2^-6 * s.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import torch

StorageDtype = Literal["bf16", "fp8_e4m3"]
STORAGE_DTYPES: tuple[str, ...] = ("bf16", "fp8_e4m3")

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value: amax maps here, so nothing saturates
FP8_REL_ERROR = 2.0**-4  # half an ulp relative to the value, 3 mantissa bits
FP8_ABS_ERROR = 2.0**-10  # half the subnormal step (2^-9), in units of the token's scale

# Bits of the stored payload, per storage dtype (zarr data type names).
_STORAGE_TORCH = {"bf16": torch.uint16, "fp8_e4m3": torch.uint8}
_STORAGE_NUMPY = {"bf16": np.dtype("uint16"), "fp8_e4m3": np.dtype("uint8")}
_LOGICAL = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
LOGICAL_DTYPE_NAMES = {"bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn"}

_BF16_EXPONENT = 0x7F80  # exponent bits all ones: Inf or NaN
_FP8_NAN = 0x7F  # e4m3fn has no Inf; S.1111.111 is its only NaN (either sign)
_CHECK_BLOCK_BYTES = 1 << 19  # NaN scan in blocks that stay in the L2 cache: ~4x faster than whole arrays


@dataclasses.dataclass(frozen=True)
class EncodedStates:
    """One layer's states of T tokens as stored: `data` [T, H] uint16 (bf16) or uint8 (fp8 e4m3),
    `scale` [T] float32 for fp8 (None for bf16). Tensors or numpy arrays, on any device."""

    dtype: str
    data: torch.Tensor | np.ndarray
    scale: torch.Tensor | np.ndarray | None = None


def check_storage_dtype(dtype: str) -> None:
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype {dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")


def storage_numpy_dtype(dtype: str) -> np.dtype:
    """The integer dtype that holds the bits of `dtype` (uint16 for bf16, uint8 for fp8 e4m3)."""
    check_storage_dtype(dtype)
    return _STORAGE_NUMPY[dtype]


def encode_states(states: torch.Tensor, dtype: str) -> EncodedStates:
    """[T, H] states (any float dtype, any device) -> their storage encoding on the same device."""
    check_storage_dtype(dtype)
    if states.dim() != 2:
        raise ValueError(f"states must be [T, H], got shape {tuple(states.shape)}")
    if dtype == "bf16":
        return EncodedStates("bf16", states.to(torch.bfloat16).contiguous().view(torch.uint16))
    x = states.float()
    amax = x.abs().amax(dim=1)  # [T]; Inf/NaN in a row make the scale non-finite
    # A tensor divisor, not the Python number: CUDA divides by a scalar as a multiplication by its
    # rounded reciprocal, a last-bit difference that changes codes; tensor division is exact on both.
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    # clamp: x / (amax / 448) can round a hair above 448, and casts need not saturate on every device
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
) -> torch.Tensor:
    """Stored bits [T, H] (+ scale [T] for fp8) -> states [T, H] in `out_dtype`, on data's device."""
    check_storage_dtype(dtype)
    bits = _as_tensor(data)
    if bits.dtype != _STORAGE_TORCH[dtype]:
        raise ValueError(f"{dtype} states are stored as {_STORAGE_TORCH[dtype]}, got {bits.dtype}")
    values = bits.view(_LOGICAL[dtype])
    if dtype == "bf16":
        return values.to(out_dtype)
    if scale is None:
        raise ValueError("fp8_e4m3 states need their per-token scale to decode")
    s = _as_tensor(scale).to(device=bits.device, dtype=torch.float32)
    return (values.float() * s[:, None]).to(out_dtype)


def nonfinite_rows(data: np.ndarray, scale: np.ndarray | None, dtype: str) -> np.ndarray:
    """Row (token) indices whose encoded states hold NaN or Inf, judged from the stored bits alone."""
    check_storage_dtype(dtype)
    rows = max(1, _CHECK_BLOCK_BYTES // max(1, data[:1].nbytes))
    bad = [start + _bad_rows(data[start: start + rows], dtype)
           for start in range(0, len(data), rows) if _block_has_nonfinite(data[start: start + rows], dtype)]
    if dtype == "fp8_e4m3" and scale is not None:
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
