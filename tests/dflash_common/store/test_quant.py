"""Storage encodings: bf16 bit-exact, fp8 e4m3 within the documented bound, NaN/Inf seen in the bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_common.store.quant import (
    FP8_ABS_ERROR, FP8_E4M3_MAX, FP8_REL_ERROR, decode_states, encode_states, nonfinite_rows,
)


def _states(t=300, h=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    x[:, 7] *= 300  # massive activation: the rest of the row sits far below amax
    x[5] = 0  # an all-zero token
    x[9, :10] = torch.tensor([1e-8, -1e-7, 3e-5, 0.0, 1e-3, -2e-4, 5e-6, 1.0, -1.0, 2.0])  # subnormal range
    return x.to(torch.bfloat16)


def test_bf16_round_trip_is_bit_exact():
    x = _states()
    enc = encode_states(x, "bf16")
    assert enc.data.dtype == torch.uint16 and enc.scale is None and enc.data.shape == x.shape
    assert torch.equal(enc.data.view(torch.bfloat16), x)
    back = decode_states(enc.data.numpy(), None, "bf16")  # through numpy, as read from the store
    assert torch.equal(back.view(torch.int16), x.view(torch.int16))


def test_fp8_round_trip_within_the_stated_bound():
    x = _states().float()
    enc = encode_states(x, "fp8_e4m3")
    assert enc.data.dtype == torch.uint8 and enc.scale.dtype == torch.float32
    s = x.abs().amax(dim=1) / FP8_E4M3_MAX
    assert torch.allclose(enc.scale, s)
    back = decode_states(enc.data, enc.scale, "fp8_e4m3", out_dtype=torch.float32)
    err = (back - x).abs()
    bound = FP8_REL_ERROR * x.abs() + FP8_ABS_ERROR * s[:, None]
    assert (err <= bound * (1 + 1e-6)).all(), (err / bound.clamp_min(1e-30)).max()
    assert err.max() > 0  # it did quantise
    # the bound is tight: some element loses close to half an ulp
    normal = (x.abs() >= 2**-6 * s[:, None]) & (x != 0)
    assert (err[normal] / x.abs()[normal]).max() > 0.5 * FP8_REL_ERROR
    assert torch.equal(back[5], torch.zeros_like(back[5])) and enc.scale[5] == 0


def _e4m3_value(code: int) -> float:
    """float8_e4m3fn by its definition: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no Inf."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def test_fp8_decoding_matches_the_e4m3_definition_for_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)[None, :]  # [1, 256]
    got = decode_states(codes, torch.tensor([2.0]), "fp8_e4m3", out_dtype=torch.float32)[0]
    want = torch.tensor([2.0 * _e4m3_value(c) for c in range(256)])
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])


def test_amax_maps_to_the_largest_finite_code_not_nan():
    x = torch.tensor([[3.0, -3.0, 1.5, 0.0]])
    enc = encode_states(x, "fp8_e4m3")
    assert enc.data[0, 0].item() == 0x7E and enc.data[0, 1].item() == 0xFE  # +-448
    assert len(nonfinite_rows(enc.data.numpy(), enc.scale.numpy(), "fp8_e4m3")) == 0


def test_nonfinite_rows_are_found_in_the_stored_bits():
    x = torch.randn(8, 16)
    x[2, 3], x[5, 0], x[6, 15] = float("nan"), float("inf"), -float("inf")
    bf = encode_states(x, "bf16")
    assert nonfinite_rows(bf.data.numpy(), None, "bf16").tolist() == [2, 5, 6]
    f8 = encode_states(x, "fp8_e4m3")
    assert nonfinite_rows(f8.data.numpy(), f8.scale.numpy(), "fp8_e4m3").tolist() == [2, 5, 6]
    clean = encode_states(torch.randn(8, 16) * 1e4, "bf16")
    assert len(nonfinite_rows(clean.data.numpy(), None, "bf16")) == 0


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_nonfinite_scan_matches_torch_on_random_bit_patterns(dtype):
    """Every bit pattern, many blocks: the blocked scan agrees with torch's own isfinite."""
    g = np.random.default_rng(0)
    bits = np.dtype(np.uint16 if dtype == "bf16" else np.uint8)
    data = g.integers(0, 2**(8 * bits.itemsize) - 1, (20000, 64), endpoint=True).astype(bits)
    data[g.random(data.shape) < 0.995] &= 0x3F  # mostly finite: only some rows carry NaN/Inf
    logical = torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn
    want = np.flatnonzero((~torch.from_numpy(data).view(logical).float().isfinite()).any(dim=1).numpy())
    assert 0 < len(want) < len(data) / 10
    assert nonfinite_rows(data, None, dtype).tolist() == want.tolist()


def test_decode_refuses_wrong_storage_dtype_and_missing_scale():
    enc = encode_states(torch.randn(4, 8), "fp8_e4m3")
    with pytest.raises(ValueError, match="scale"):
        decode_states(enc.data, None, "fp8_e4m3")
    with pytest.raises(ValueError, match="stored as"):
        decode_states(enc.data, None, "bf16")
    with pytest.raises(ValueError, match="storage dtype"):
        encode_states(torch.randn(4, 8), "fp16")


def test_numpy_and_torch_inputs_decode_alike():
    enc = encode_states(torch.randn(32, 8), "fp8_e4m3")
    a = decode_states(enc.data, enc.scale, "fp8_e4m3")
    b = decode_states(np.asarray(enc.data.numpy()), enc.scale.numpy(), "fp8_e4m3")
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_encoding_on_the_gpu_matches_the_cpu(dtype):
    x = _states(1024, 256).float()
    cpu = encode_states(x, dtype)
    gpu = encode_states(x.cuda(), dtype)
    diff = (gpu.data.cpu() != cpu.data).nonzero()
    assert diff.numel() == 0, (
        f"{len(diff)} codes differ, e.g. at {diff[:3].tolist()}: gpu {gpu.data.cpu()[tuple(diff[0])]}, "
        f"cpu {cpu.data[tuple(diff[0])]}, x {x[tuple(diff[0])].item()!r}, "
        f"scale gpu {gpu.scale.cpu()[diff[0, 0]].item() if gpu.scale is not None else None!r} "
        f"cpu {cpu.scale[diff[0, 0]].item() if cpu.scale is not None else None!r}"
    )
    if dtype == "fp8_e4m3":
        assert torch.equal(gpu.scale.cpu(), cpu.scale)
        back = decode_states(gpu.data, gpu.scale, dtype, out_dtype=torch.float32)
        assert back.is_cuda
