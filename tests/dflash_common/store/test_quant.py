"""Storage encodings: bf16 bit-exact, fp8 e4m3 and q4_hadamard within their documented bounds,
NaN/Inf seen in the bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_common.store import quant
from dflash_common.store.quant import (
    FP8_ABS_ERROR,
    FP8_E4M3_MAX,
    FP8_REL_ERROR,
    Q4_GROUP,
    Q4_LARGEST_GAP,
    Q4_LEVELS,
    decode_states,
    encode_states,
    hadamard,
    hadamard_by_matmul,
    nonfinite_rows,
    row_size,
)


# the Triton kernel's device: a GPU where there is one, else the CPU under TRITON_INTERPRET=1
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _states(t=300, h=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    x[:, 7] *= 300  # massive activation: the rest of the row sits far below amax
    x[5] = 0  # an all-zero token
    # subnormal range
    x[9, :10] = torch.tensor([1e-8, -1e-7, 3e-5, 0.0, 1e-3, -2e-4, 5e-6, 1.0, -1.0, 2.0])
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
    q4 = encode_states(x, "q4_hadamard")
    assert nonfinite_rows(q4.data.numpy(), q4.scale.numpy(), "q4_hadamard").tolist() == [2, 5, 6]
    clean = encode_states(torch.randn(8, 16) * 1e4, "bf16")
    assert len(nonfinite_rows(clean.data.numpy(), None, "bf16")) == 0


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_nonfinite_scan_matches_torch_on_random_bit_patterns(dtype):
    """Every bit pattern, many blocks: the blocked scan agrees with torch's own isfinite."""
    g = np.random.default_rng(0)
    bits = np.dtype(np.uint16 if dtype == "bf16" else np.uint8)
    data = g.integers(0, 2 ** (8 * bits.itemsize) - 1, (20000, 64), endpoint=True).astype(bits)
    data[g.random(data.shape) < 0.995] &= 0x3F  # mostly finite: only some rows carry NaN/Inf
    logical = torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn
    want = np.flatnonzero(
        (~torch.from_numpy(data).view(logical).float().isfinite()).any(dim=1).numpy()
    )
    assert 0 < len(want) < len(data) / 10
    assert nonfinite_rows(data, None, dtype).tolist() == want.tolist()


def test_a_nan_group_scale_byte_is_found_and_codes_never_count():
    """A q4 row's 4-bit codes are all finite levels (every byte value is valid there); only its
    group scale bytes can hold the e4m3 NaN."""
    enc = encode_states(torch.randn(6, 64), "q4_hadamard")
    data, scale = enc.data.numpy().copy(), enc.scale.numpy()
    data[:, :32] = 0xFF  # code bytes: levels 15 and 15, not a NaN
    assert len(nonfinite_rows(data, scale, "q4_hadamard")) == 0
    data[4, 32 + 2] = 0x7F  # a group scale byte of row 4
    assert nonfinite_rows(data, scale, "q4_hadamard").tolist() == [4]


def _sylvester64(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while len(h) < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def _rotate64(x: torch.Tensor) -> torch.Tensor:
    """R x in float64 from the spec's words: a Sylvester Hadamard / sqrt(B) on each block of B
    values, B the largest power of two dividing H."""
    h = x.shape[1]
    block = h & -h
    return (x.double().reshape(-1, block) @ _sylvester64(block).T).reshape(x.shape)


@pytest.mark.parametrize("h", [64, 96, 256])  # 96: blocks of 32 (H not a power of two)
def test_hadamard_is_the_blockwise_sylvester_transform_and_its_own_inverse(h):
    x = torch.randn(50, h)
    want = _rotate64(x)
    assert torch.allclose(hadamard(x).double(), want, atol=1e-5)
    assert torch.allclose(hadamard_by_matmul(x).double(), want, atol=1e-5)
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-5)


@pytest.mark.parametrize("h", [96, 256])
def test_q4_round_trip_within_the_stated_bound(h):
    """Per group of the rotated vector: ||error|| <= sqrt(16) * (largest gap / 2) * d_up, d_up the
    no-clip step ((1 + 2^-3) a_g / L + 2^-9 S) (quant.py's docstring)."""
    x = _states(300, h).float()
    enc = encode_states(x, "q4_hadamard")
    assert enc.data.dtype == torch.uint8 and enc.data.shape == (
        300,
        row_size("q4_hadamard", h),
    ) == (300, 9 * h // 16)
    assert enc.scale.dtype == torch.float32 and enc.scale.shape == (300,)
    back = decode_states(enc.data, enc.scale, "q4_hadamard", out_dtype=torch.float32)
    y, y_back = _rotate64(x), _rotate64(back)  # errors keep their size through the rotation
    groups = y.view(300, h // Q4_GROUP, Q4_GROUP)
    a = groups.abs().amax(dim=2)  # [T, n]
    top = max(Q4_LEVELS)
    s = a.amax(dim=1, keepdim=True) / (top * FP8_E4M3_MAX)
    assert torch.allclose(enc.scale.double(), s[:, 0], rtol=1e-6)
    d_up = (1 + 2**-3) * a / top + 2**-9 * s
    err = (y_back - y).view(groups.shape).norm(dim=2)
    bound = Q4_GROUP**0.5 * Q4_LARGEST_GAP / 2 * d_up
    assert (err <= bound * (1 + 1e-5) + 1e-9).all(), (err / bound.clamp_min(1e-30)).max()
    assert (err / bound.clamp_min(1e-30)).max() > 0.3  # not vacuous
    # the all-zero token
    assert torch.equal(back[5], torch.zeros_like(back[5])) and enc.scale[5] == 0
    gauss = torch.randn(300, h, generator=torch.Generator().manual_seed(1))
    enc = encode_states(gauss, "q4_hadamard")
    back = decode_states(enc.data, enc.scale, "q4_hadamard", out_dtype=torch.float32)
    rel = ((back - gauss).norm(dim=1) / gauss.norm(dim=1)).mean()
    assert 0.06 < rel < 0.08, rel  # 4 bits on normal vectors: ~0.072 (fp8: ~0.026)


@pytest.mark.parametrize(
    "backend,h",
    [("torch", 96), ("triton", 256), ("triton", 512), ("triton", 1536)],  # 1536: 3 blocks of 512
)
def test_q4_decoding_follows_the_spec_for_every_code(backend, h):
    """Hand-made rows: code bytes (low nibble = the even value), e4m3 group scale bytes, a float32
    token scale, then the rotation; checked against the spec's words in float64, for the torch
    decoder and the Triton kernel (on the CPU under TRITON_INTERPRET=1)."""
    g = torch.Generator().manual_seed(3)
    t = 20
    codes = torch.randint(0, 16, (t, h), generator=g)
    codes[0, :16] = torch.arange(16)
    # every non-NaN code
    gscale = torch.randint(0, 0x7F, (t, h // Q4_GROUP), generator=g).to(torch.uint8)
    scale = torch.rand(t, generator=g) * 3
    data = torch.cat([(codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8), gscale], dim=1)
    dev = _DEVICE if backend == "triton" else "cpu"
    got = decode_states(
        data.to(dev), scale.to(dev), "q4_hadamard", out_dtype=torch.float32, backend=backend
    ).cpu()
    values = [_e4m3_value(int(c)) for c in gscale.flatten()]
    step = torch.tensor(values, dtype=torch.float64).view(t, -1) * scale.double()[:, None]
    y = torch.tensor(Q4_LEVELS, dtype=torch.float64)[codes] * step.repeat_interleave(
        Q4_GROUP, dim=1
    )
    want = _rotate64(y)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max())


@pytest.mark.parametrize("h", [256, 512, 5120])
def test_q4_triton_kernel_decodes_as_torch(h):
    """The kernel against the torch decoder on encoded states: float32 within a few float32 ulps of
    the row's largest value, bf16 the same bits wherever the float32 values round alike, and into a
    strided output (one layer's columns of a batch's features), one token or several a program."""
    from dflash_common.store import q4_triton

    x = _states(40, h).float().to(_DEVICE)
    enc = encode_states(x, "q4_hadamard")
    want = decode_states(enc.data, enc.scale, "q4_hadamard", out_dtype=torch.float32,
                         backend="torch")  # fmt: skip
    got = decode_states(enc.data, enc.scale, "q4_hadamard", out_dtype=torch.float32,
                        backend="triton")  # fmt: skip
    tol = 1e-5 * want.abs().amax(dim=1, keepdim=True)  # tf32x3 products on a GPU
    assert ((got - want).abs() <= tol).all(), ((got - want).abs() / tol).max()
    bf = decode_states(enc.data, enc.scale, "q4_hadamard", backend="triton")
    assert bf.dtype == torch.bfloat16
    alike = got.to(torch.bfloat16) == want.to(torch.bfloat16)
    assert torch.equal(bf[alike], want.to(torch.bfloat16)[alike])
    assert alike.float().mean() > 0.95
    for tokens in (1, 4):  # 40 = 10 programs of 4 tokens; 4 tokens from 37 on: a masked program
        for n in (40, 37):
            wide = torch.full((n, 3 * h), 7.0, device=_DEVICE)
            q4_triton.q4_decode(
                enc.data[:n],
                enc.scale[:n],
                quant.hadamard_split(h),
                torch.tensor(Q4_LEVELS, device=_DEVICE),
                wide[:, h : 2 * h],
                tokens,
            )
            # each configuration within the tolerance (GPU products may round in another order)
            assert ((wide[:, h : 2 * h] - want[:n]).abs() <= tol[:n]).all()
            assert (wide[:, :h] == 7).all() and (wide[:, 2 * h :] == 7).all()


def test_auto_takes_the_kernel_only_where_its_first_decode_agrees_with_torch(monkeypatch):
    """ "auto" checks the kernel's first decode of a hidden size on a device against the torch
    decoder (its first 64 rows): the real kernel passes and decodes from then on; a wrong one is
    refused with a warning and torch decodes, that batch included and every one after it ("auto"
    is made to reach the kernel on the CPU here)."""
    from dflash_common.store import q4_triton

    enc = encode_states(_states(80, 256).float(), "q4_hadamard")
    want = decode_states(enc.data, enc.scale, "q4_hadamard", backend="torch")
    real = q4_triton.q4_decode
    calls = []

    def counted(bits, *args, **kwargs):
        calls.append(len(bits))
        return real(bits, *args, **kwargs)

    def reach_the_kernel(backend, device, hidden):  # _q4_backend as on a GPU
        return quant._CHECKED.get((str(device), hidden), "triton") if backend == "auto" else backend

    monkeypatch.setattr(quant, "_q4_backend", reach_the_kernel)
    monkeypatch.setattr(quant, "_CHECKED", {})
    monkeypatch.setattr(q4_triton, "q4_decode", counted)
    for dtype in (torch.bfloat16, torch.float32):
        got = decode_states(enc.data, enc.scale, "q4_hadamard", out_dtype=dtype)
        assert (got.float() - want.float()).abs().max() <= 0.01 * want.float().abs().max()
    assert calls == [80, 80] and quant._CHECKED == {("cpu", 256): "triton"}  # checked once

    def wrong(bits, scale, split, levels, out, tokens_per_program=None):
        return out.copy_(real(bits, scale, split, levels, out).roll(1, dims=1))

    monkeypatch.setattr(quant, "_CHECKED", {})
    monkeypatch.setattr(q4_triton, "q4_decode", wrong)
    with pytest.warns(UserWarning, match="disagrees with the torch decoder"):
        got = decode_states(enc.data, enc.scale, "q4_hadamard")
    assert torch.equal(got, want) and quant._CHECKED == {("cpu", 256): "torch"}
    monkeypatch.setattr(q4_triton, "q4_decode", counted)
    calls.clear()
    assert torch.equal(decode_states(enc.data, enc.scale, "q4_hadamard"), want) and calls == []


def test_q4_triton_kernel_refuses_blocks_below_16_by_16():
    enc = encode_states(torch.randn(4, 96), "q4_hadamard")  # block 32 = 4 x 8
    with pytest.raises(ValueError, match="at least 16 x 16, not 4 x 8"):
        decode_states(enc.data, enc.scale, "q4_hadamard", backend="triton")
    with pytest.raises(ValueError, match="decode backend"):
        decode_states(enc.data, enc.scale, "q4_hadamard", backend="cuda")


def test_q4_chooses_the_better_of_two_scales_and_encodes_in_slices_alike(monkeypatch):
    x = _states(64, 128).float()
    whole = encode_states(x, "q4_hadamard")
    monkeypatch.setattr(quant, "_Q4_ROWS", 128 * 5)  # 5 rows a slice
    sliced = encode_states(x, "q4_hadamard")
    assert torch.equal(whole.data, sliced.data) and torch.equal(whole.scale, sliced.scale)
    # both scale codes are taken somewhere: the search is real
    y = _rotate64(x).view(64, 8, Q4_GROUP)
    ratio = y.abs().amax(dim=2) / (max(Q4_LEVELS) * whole.scale.double()[:, None])
    chosen = torch.tensor([_e4m3_value(int(c)) for c in whole.data[:, 64:].flatten()]).view(64, 8)
    nonzero = ratio > 0
    below = (chosen < ratio.float() * (1 - 1e-6)) & nonzero
    assert below.any() and (~below & nonzero).any()


def test_q4_needs_a_hidden_size_of_whole_groups():
    with pytest.raises(ValueError, match="multiple of 16"):
        encode_states(torch.randn(4, 40), "q4_hadamard")


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
@pytest.mark.parametrize(
    "dtype,h",
    [
        ("bf16", 256),
        ("fp8_e4m3", 256),
        ("q4_hadamard", 256),
        ("q4_hadamard", 4096),
        ("q4_hadamard", 5120),
    ],
)
def test_encoding_on_the_gpu_matches_the_cpu(dtype, h):
    x = _states(1024, h).float()
    cpu = encode_states(x, dtype)
    gpu = encode_states(x.cuda(), dtype)
    diff = (gpu.data.cpu() != cpu.data).nonzero()
    assert diff.numel() == 0, (
        f"{len(diff)} codes differ, e.g. at {diff[:3].tolist()}: "
        f"gpu {gpu.data.cpu()[tuple(diff[0])]}, "
        f"cpu {cpu.data[tuple(diff[0])]}, x {x[tuple(diff[0])].item()!r}, "
        f"scale gpu {gpu.scale.cpu()[diff[0, 0]].item() if gpu.scale is not None else None!r} "
        f"cpu {cpu.scale[diff[0, 0]].item() if cpu.scale is not None else None!r}"
    )
    if dtype != "bf16":
        assert torch.equal(gpu.scale.cpu(), cpu.scale)
        back = decode_states(gpu.data, gpu.scale, dtype, out_dtype=torch.float32)
        assert back.is_cuda
        want = decode_states(cpu.data, cpu.scale, dtype, out_dtype=torch.float32)
        assert torch.allclose(back.cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max())
