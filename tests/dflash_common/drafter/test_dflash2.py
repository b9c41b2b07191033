"""The DFlash2 drafter (dflash2.py) against the released layout and against other ways to compute
the same: names and shapes as vLLM and z-lab's checkpoint hold them, a fresh DFlash2 drafter
drafting as the DFlash drafter it extends, the convolution causal inside each block, the KV-cached
drafting path against the training forward, the greedy walk and its tie rule, and the Triton kernels
against the torch convolution (values and gradients, under TRITON_INTERPRET=1 on a CPU)."""

from __future__ import annotations

import json

import pytest
import torch

import dflash_common.drafter.dflash2 as dflash2
from dflash_common.config import ConfigError
from dflash_common.drafter.arch import config_from_json, new_drafter
from dflash_common.drafter.config import DrafterConfig
from dflash_common.drafter.dflash2 import DFlash2Drafter, grouped_conv, grouped_conv_torch, walk
from dflash_common.drafter.model import DFlashDrafter

from drafter_testlib import (
    ANCHORS,
    TINY_MASK_ID,
    packed_batch,
    randomise_dflash2,
    tiny_config,
    tiny_drafter,
)

D2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def _cfg(tiny_target, **d2) -> DrafterConfig:
    return tiny_config(tiny_target, arch="dflash2", **{**D2, **d2})


# -- config and weights: the released layout ------------------------------------------------------


def test_config_json_names_dflash2_and_its_four_keys_and_reads_back(tiny_target):
    cfg = _cfg(tiny_target)
    data = cfg.to_config_json()
    assert data["architectures"] == ["DFlash2DraftModel"]
    dc = data["dflash_config"]
    assert {
        k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    } == {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    assert dc["output_multiplier"] == 1.0 and dc["final_logit_softcapping"] == 0.0
    assert (
        dc["block_size"] == cfg.block_size
    )  # SGLang's conv block when the command line gives none
    assert config_from_json(json.loads(json.dumps(data))) == cfg
    assert "dflash_config" in tiny_config(tiny_target).to_config_json()
    assert tiny_config(tiny_target).to_config_json()["architectures"] == ["DFlashDraftModel"]
    dc.pop("selector_top_k")
    with pytest.raises(ConfigError, match="selector_top_k"):
        config_from_json(data)


def test_z_labs_released_geometry_reads_with_its_multiplier_and_cap(tiny_target):
    data = _cfg(tiny_target).to_config_json()
    data["dflash_config"] |= {
        "output_multiplier": 0.19611613513818404,
        "final_logit_softcapping": 20.0,
    }
    d2 = config_from_json(data)
    assert (d2.output_multiplier, d2.final_logit_softcapping) == (0.19611613513818404, 20.0)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"conv_group_size": 24}, "must divide hidden_size"),
        ({"selector_top_k": 10**6}, "selector_top_k"),
        ({"output_multiplier": 0.0}, "output_multiplier"),
    ],
)
def test_a_geometry_the_engines_refuse_is_refused_naming_the_field(tiny_target, bad, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tiny_target, **bad)


def test_weight_names_and_shapes_are_the_released_layout(tiny_target):
    """z-lab's DFlash2 safetensors header and vLLM's parameters: per layer base_kernel [2, T, H] and
    kernel_projection [2*T*G, H]; bare codebook names [V, r]; hidden_projection [r, H]; the rest as
    DFlash; no embedding, no lm_head."""
    cfg = _cfg(tiny_target, conv_kernel_size=3)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in new_drafter(cfg).state_dict().items()}
        dflash = {
            n: tuple(p.shape)
            for n, p in DFlashDrafter(tiny_config(tiny_target)).state_dict().items()
        }
    h, v, t, g, r = cfg.hidden_size, cfg.vocab_size, 3, cfg.hidden_size // 16, 8
    extra = {
        "candidate_selector.predecessor_codebook": (v, r),
        "candidate_selector.successor_codebook": (v, r),
        "candidate_selector.hidden_projection.weight": (r, h),
    }
    for i in range(cfg.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            extra |= {
                f"layers.{i}.{conv}.base_kernel": (2, t, h),
                f"layers.{i}.{conv}.kernel_projection.weight": (2 * t * g, h),
            }
    assert shapes == dflash | extra
    assert isinstance(new_drafter(tiny_config(tiny_target)), DFlashDrafter)
    assert not isinstance(new_drafter(tiny_config(tiny_target)), DFlash2Drafter)


# -- the start: a DFlash drafter ----------------------------------------------------------------


def test_a_fresh_dflash2_drafter_drafts_as_the_dflash_drafter_with_its_weights(tiny_target):
    """Identity convolutions and a zero successor codebook (the trainers' start): the same block
    hidden states and the same served tokens (the walk picks each position's argmax)."""
    cfg = _cfg(tiny_target)
    torch.manual_seed(0)
    d2 = new_drafter(cfg)  # its own start, not tiny_drafter's scaled one
    d1 = DFlashDrafter(tiny_config(tiny_target))
    d1.load_state_dict({k: v for k, v in d2.state_dict().items() if k in d1.state_dict()})
    g = torch.Generator().manual_seed(1)
    frozen = [torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) for _ in range(2)]
    d1.attach_frozen(*frozen)
    d2.attach_frozen(*frozen)
    context, input_ids, cu = packed_batch(cfg)
    anchors = torch.tensor(ANCHORS)
    with torch.no_grad():
        h2, h1 = d2(context, input_ids, cu, anchors), d1(context, input_ids, cu, anchors)
        torch.testing.assert_close(h2, h1, rtol=0, atol=0)
        first = input_ids[anchors]
        assert torch.equal(d2.greedy_drafts(h2, first), d1.greedy_drafts(h1, first))
    assert d2.candidate_selector.successor_codebook.abs().sum() == 0


# -- the convolution ------------------------------------------------------------------------------


def _conv_loop(x, delta, base, block, group):
    """The formula, one row, tap and channel at a time."""
    rows, hidden = x.shape
    out = torch.zeros_like(x)
    for i in range(rows):
        for t in range(base.shape[0]):
            if i % block >= t:
                for c in range(hidden):
                    out[i, c] += (base[t, c] + delta[i, t, c // group]) * x[i - t, c]
    return out


def test_the_torch_convolution_is_the_formula_and_its_gradient_checks():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, dtype=torch.float64, generator=g, requires_grad=True)
    delta = torch.randn(10, 3, 2, dtype=torch.float64, generator=g, requires_grad=True)
    base = torch.randn(3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    torch.testing.assert_close(
        grouped_conv_torch(x, delta, base, 4, 4), _conv_loop(x, delta, base, 4, 4)
    )
    assert torch.autograd.gradcheck(lambda *a: grouped_conv_torch(*a, 4, 4), (x, delta, base))


def test_the_convolution_is_causal_inside_each_block_and_never_crosses_one():
    g = torch.Generator().manual_seed(1)
    x, delta, base = (
        torch.randn(12, 16, generator=g),
        torch.randn(12, 3, 4, generator=g),
        torch.randn(3, 16, generator=g),
    )
    out = grouped_conv_torch(x, delta, base, 4, 4)
    moved = x.clone()
    moved[5] += 1.0  # block 1 (rows 4..7), position 1
    diff = (grouped_conv_torch(moved, delta, base, 4, 4) - out).abs().sum(-1)
    assert diff[[5, 6, 7]].gt(0).all()  # itself and the two taps after it, inside its block
    assert (
        diff[[0, 1, 2, 3, 4, 8, 9, 10, 11]].eq(0).all()
    )  # nothing before it, nothing in other blocks


@pytest.mark.parametrize(
    "rows, hidden, taps, group, block, dtype",
    [
        (24, 64, 2, 16, 8, torch.float32),  # the default geometry
        (21, 96, 3, 8, 7, torch.float32),  # rows not a multiple of the kernel's tile, odd block
        (40, 256, 2, 16, 16, torch.float32),  # more than one channel tile
        (9, 32, 1, 4, 3, torch.float32),  # one tap: the dynamic scale alone
        (16, 64, 2, 16, 4, torch.bfloat16),  # bf16 in and out, float32 inside
    ],
)
def test_the_triton_kernels_give_the_torch_convolution_and_its_gradients(
    rows, hidden, taps, group, block, dtype
):
    """Forward and backward kernels (conv_triton.py) against autograd through the torch version,
    with delta a strided view of the [R, 2, T, G] projection output as the layers pass it."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(dtype).requires_grad_()
    proj = torch.randn(rows, 2, taps, hidden // group, generator=g).to(dtype).requires_grad_()
    base = torch.randn(taps, hidden, generator=g).requires_grad_()
    dout = torch.randn(rows, hidden, generator=g).to(dtype)
    results = []
    for backend in ("torch", "triton"):
        out = grouped_conv(x, proj[:, 1], base, block, group, backend=backend)
        grads = torch.autograd.grad(out, (x, proj, base), dout)
        results.append((out.detach(), *grads))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for name, want, got in zip(("out", "d x", "d delta", "d base"), *results):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=name)
    assert results[1][2][:, 0].abs().sum() == 0  # the other side's delta gets no gradient


def test_the_drafter_runs_the_triton_convolution_as_the_torch_one(tiny_target, monkeypatch):
    cfg = _cfg(tiny_target)
    drafter = randomise_dflash2(tiny_drafter(cfg))
    context, input_ids, cu = packed_batch(cfg)
    with torch.no_grad():
        want = drafter(context, input_ids, cu, torch.tensor(ANCHORS))
        monkeypatch.setattr(dflash2, "CONV_BACKEND", "triton")
        got = drafter(context, input_ids, cu, torch.tensor(ANCHORS))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


# -- drafting: the cache path and the walk ---------------------------------------------------------


def test_drafting_with_the_cache_equals_the_training_forward(tiny_target):
    """One served block convolves as the training forward's block rows (positions mod B)."""
    cfg = _cfg(tiny_target)
    drafter = randomise_dflash2(tiny_drafter(cfg))
    context, input_ids, cu = packed_batch(cfg)
    anchors = torch.tensor([13, 23])  # sequence 1 starts at 11: local anchors 2 and 12
    mask = [TINY_MASK_ID] * (cfg.block_size - 1)
    with torch.no_grad():
        want = drafter(context, input_ids, cu, anchors)
        cache = drafter.new_cache()
        first = drafter.draft(cache, context[11:13], torch.tensor([int(input_ids[13])] + mask))
        torch.testing.assert_close(first, want[0], rtol=1e-4, atol=1e-4)
        second = drafter.draft(cache, context[13:23], torch.tensor([int(input_ids[23])] + mask))
        torch.testing.assert_close(second, want[1], rtol=1e-4, atol=1e-4)
        tokens = drafter.greedy_drafts(want, input_ids[anchors])
        assert torch.equal(tokens[1], drafter.greedy_drafts(second[None], input_ids[23:24])[0])


def _walk_reference(drafter, hidden, first):
    """The served path written out: top-k of each prediction row's logits, each step's scores from
    the previous choice (the first token at step 1), argmax with the lowest index on ties."""
    sel, k = drafter.candidate_selector, drafter.cfg.selector_top_k
    out = []
    for block, tok in zip(hidden, first.tolist()):
        path, prev = [], tok
        for row in block[1:]:
            values, ids = torch.topk(row @ drafter.lm_head_weight.T, k)
            q = sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ row)
            scores = values + sel.successor_codebook[ids] @ q
            j = int(torch.nonzero(scores == scores.max())[0])
            prev = int(ids[j])
            path.append(prev)
        out.append(path)
    return torch.tensor(out)


def test_the_served_tokens_are_the_greedy_walk_through_the_candidates(tiny_target):
    cfg = _cfg(tiny_target)
    drafter = randomise_dflash2(tiny_drafter(cfg))
    context, input_ids, cu = packed_batch(cfg)
    anchors = torch.tensor(ANCHORS)
    with torch.no_grad():
        hidden = drafter(context, input_ids, cu, anchors)
        got = drafter.greedy_drafts(hidden, input_ids[anchors])
        unary = drafter.logits(hidden[:, 1:]).argmax(-1)
    assert torch.equal(got, _walk_reference(drafter, hidden, input_ids[anchors]))
    assert not torch.equal(got, unary)  # the selector changed something: the walk is not the argmax


def test_the_walk_follows_the_chosen_candidates_row_and_breaks_ties_to_the_lowest_index():
    ids = torch.arange(12).view(1, 3, 4) + 100
    scores = torch.zeros(1, 3, 4, 4)
    scores[0, 0, 0] = torch.tensor([0.0, 2.0, 2.0, 1.0])  # step 1 reads row 0: tie 1/2 -> 1
    scores[0, 1, 1] = torch.tensor([0.0, 0.0, 0.0, 3.0])  # step 2 reads row 1 (chosen before) -> 3
    scores[0, 1, 0] = torch.tensor([9.0, 0.0, 0.0, 0.0])  # row 0 is not read
    scores[0, 2, 3] = torch.tensor([1.0, 1.0, 1.0, 1.0])  # all tie -> 0
    assert walk(ids, scores).tolist() == [[101, 107, 108]]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_kernels_on_the_gpu_give_the_torch_convolution(dtype):
    """The kernels as the GPU compiles them (the interpreter checks only their arithmetic), at a
    Qwen3-8B-sized hidden size and a training batch's rows."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, hidden, taps, group, block = 16 * 300, 4096, 2, 16, 16
    x = torch.randn(rows, hidden, generator=g, device="cuda").to(dtype).requires_grad_()
    proj = torch.randn(rows, 2, taps, hidden // group, generator=g, device="cuda").to(dtype)
    proj.requires_grad_()
    base = torch.randn(taps, hidden, generator=g, device="cuda").requires_grad_()
    dout = torch.randn(rows, hidden, generator=g, device="cuda").to(dtype)
    results = []
    for backend in ("torch", "triton"):
        out = grouped_conv(x, proj[:, 1], base, block, group, backend=backend)
        grads = torch.autograd.grad(out, (x, proj, base), dout)
        results.append((out.detach(), *grads))
    for name, want, got in zip(("out", "d x", "d delta", "d base"), *results):
        scale = want.float().abs().max().clamp(min=1.0)
        err = float((got.float() - want.float()).abs().max() / scale)
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), f"{name}: {err:.3g}"


@pytest.mark.gpu
def test_a_dflash2_step_on_the_gpu_under_autocast_is_finite_and_reaches_every_weight(tiny_target):
    from types import SimpleNamespace

    from train.objective import batch_objective

    cfg = _cfg(tiny_target)
    drafter = randomise_dflash2(tiny_drafter(cfg)).cuda()
    drafter.attach_frozen(
        drafter.embed_weight.cuda().bfloat16(), drafter.lm_head_weight.cuda().bfloat16()
    )
    context, input_ids, cu = (t.cuda() for t in packed_batch(cfg))
    batch = SimpleNamespace(
        features=context,
        input_ids=input_ids,
        loss_mask=torch.ones_like(input_ids, dtype=torch.bool),
        cu_seqlens=cu,
        anchors=torch.tensor(ANCHORS, device="cuda"),
    )
    loss, norm, counts = batch_objective(
        drafter,
        drafter,
        batch,
        block_size=cfg.block_size,
        gamma=None,
        autocast="bf16",
        weights="dpace",
    )
    (loss / norm).backward()
    assert loss.isfinite() and counts.isfinite().all()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all(), name
