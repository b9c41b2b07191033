"""Which keys a block's queries see, against references computed another way: a per-block dense-mask
forward written from scratch here (transformers' own RoPE, explicit boolean masks, plain softmax) by
the serving engines' rule, and create_block_mask's tile tables; every attention backend is checked
(chunked and flex on the CPU, compiled flex on the GPU, dense when drafting)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash_common.drafter.attention import BlockLayout

from drafter_testlib import ANCHORS, TINY_MASK_ID, packed_batch, tiny_config, tiny_drafter


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def engine_visible(layer_type, q_pos, k_pos, window):
    """[b, L] which keys a block query sees, by the serving engines' rule, written from their code:
    vLLM 0.32 `_dflash_layer_causal` (no is_causal/dflash_config.causal: causal iff the layer is
    sliding_attention) with `per_layer_sliding_window` (q - k < window), SGLang (full_attention is
    ENCODER_ONLY attention, sliding_attention is DECODER attention with window_left = window - 1)."""
    seen = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)  # ENCODER_ONLY: everything given
    if layer_type == "sliding_attention":
        for i, q in enumerate(q_pos.tolist()):
            for j, k in enumerate(k_pos.tolist()):
                seen[i, j] = k <= q and q - k <= window - 1  # DECODER, window_left keys back
    return seen


def _reference_block(drafter, fused_ctx, anchor_tokens_and_pos, layer_windows):
    """One block, its own sequence's context [0, anchor) only, written out by hand; each layer's
    attention by the engines' rule for its type (`engine_visible`)."""
    cfg = drafter.cfg
    token, anchor = anchor_tokens_and_pos
    b, nh, nkv, d = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ids = torch.tensor([token] + [cfg.mask_token_id] * (b - 1))
    x = drafter.embed_weight[ids]  # [B, H]
    ctx = fused_ctx[:anchor]  # strictly before the anchor
    rotary = Qwen3RotaryEmbedding(cfg.to_hf_config())
    k_pos = torch.cat([torch.arange(anchor), anchor + torch.arange(b)])
    q_pos = anchor + torch.arange(b)
    cos, sin = rotary(x, k_pos[None])
    for layer, layer_type, window in zip(drafter.layers, cfg.layer_types, layer_windows):
        at = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
        both = torch.cat([ctx, h])  # keys/values: context first, then the block
        q = _rms(at.q_proj(h).view(b, nh, d), at.q_norm.weight, cfg.rms_norm_eps)
        k = _rms(at.k_proj(both).view(-1, nkv, d), at.k_norm.weight, cfg.rms_norm_eps)
        v = at.v_proj(both).view(-1, nkv, d)
        q, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[:, anchor:], sin[:, anchor:])
        k, _ = apply_rotary_pos_emb(k.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        k, v = k.repeat_interleave(nh // nkv, 1), v.transpose(0, 1)[None].repeat_interleave(nh // nkv, 1)
        allowed = engine_visible(layer_type, q_pos, k_pos, window)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v  # [1, nh, B, D]
        x = x + at.o_proj(attn[0].transpose(0, 1).reshape(b, nh * d))
        h = _rms(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        x = x + layer.mlp.down_proj(torch.nn.functional.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
    return _rms(x, drafter.norm.weight, cfg.rms_norm_eps)


def _reference(drafter, context, input_ids, cu, anchors):
    cfg = drafter.cfg
    fused = _rms(drafter.fc(context), drafter.hidden_norm.weight, cfg.rms_norm_eps)
    windows = [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]
    out = []
    for a in anchors:
        s = int(cu[cu <= a].max())
        e = int(cu[cu > a].min())
        out.append(_reference_block(drafter, fused[s:e], (int(input_ids[a]), a - s), windows))
    return torch.stack(out)


LAYER_TYPES = {"mixed": ["sliding_attention", "full_attention"], "sliding": ["sliding_attention"] * 2,
               "full": ["full_attention"] * 2}


@pytest.mark.parametrize("types", sorted(LAYER_TYPES))
@pytest.mark.parametrize("path", ["chunked", "chunked-with-grad", "flex-eager", "flex-dense-with-grad",
                                  "chunked-one-row-a-time", "chunked-few-rows"])
def test_training_forward_matches_dense_reference(tiny_target, path, types, monkeypatch):
    """Every attention path of the training forward: the CPU's chunked dense attention (with and without
    a gradient, and with one query row per chunk), and the flex path the GPU runs (eager flex_attention;
    with a gradient, its mask_mod densified), against the rule written another way."""
    import dflash_common.drafter.attention as attention

    window = 5 if "sliding_attention" in LAYER_TYPES[types] else None
    cfg = tiny_config(tiny_target, layer_types=LAYER_TYPES[types], sliding_window=window)
    drafter = tiny_drafter(cfg)
    context, input_ids, cu = packed_batch(cfg)
    grad = path.endswith("with-grad")
    monkeypatch.setattr(attention, "FLEX_ON_CPU", path.startswith("flex"))
    if path == "chunked-one-row-a-time":
        monkeypatch.setattr(attention, "_CPU_SCORES_PER_CHUNK", 1)
    if path == "chunked-few-rows":  # chunks that end inside a block and span two sequences
        monkeypatch.setattr(attention, "_CPU_ROWS_PER_CHUNK", 5)
    with torch.set_grad_enabled(grad):
        got = drafter(context, input_ids, cu, torch.tensor(ANCHORS))
    with torch.no_grad():
        want = _reference(drafter, context, input_ids, cu, ANCHORS)
    assert got.shape == (len(ANCHORS), cfg.block_size, cfg.hidden_size)
    torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the draft logits the engine would compute, not only the hidden states
        torch.testing.assert_close(drafter.logits(got.detach()), drafter.logits(want), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("types", sorted(LAYER_TYPES))
def test_spec_decode_drafting_matches_the_engine_rule(tiny_target, types):
    """The drafting path (KV-cached context, one block at a time) against the engines' rule, written
    another way, on blocks near a sequence's start and far enough for the window to cut the context."""
    window = 5 if "sliding_attention" in LAYER_TYPES[types] else None
    cfg = tiny_config(tiny_target, layer_types=LAYER_TYPES[types], sliding_window=window)
    drafter = tiny_drafter(cfg)
    context, input_ids, cu = packed_batch(cfg)
    seq_ctx, seq_ids = context[11:], input_ids[11:]
    mask = [TINY_MASK_ID] * (cfg.block_size - 1)
    with torch.no_grad():
        fused = _rms(drafter.fc(seq_ctx), drafter.hidden_norm.weight, cfg.rms_norm_eps)
        windows = [cfg.layer_sliding_window(i) for i in range(cfg.num_hidden_layers)]
        cache, seen = drafter.new_cache(), 0
        for anchor in (3, 12):
            got = drafter.draft(cache, seq_ctx[seen:anchor], torch.tensor([int(seq_ids[anchor])] + mask))
            seen = anchor
            want = _reference_block(drafter, fused, (int(seq_ids[anchor]), anchor), windows)
            torch.testing.assert_close(drafter.logits(got), drafter.logits(want), rtol=1e-4, atol=1e-3)


def test_a_sliding_layer_block_is_causal_and_a_full_layer_block_is_not(tiny_target):
    """Changing the last block token moves the earlier outputs of a full-layer drafter only."""
    for types, moves in (("sliding", False), ("full", True)):
        window = 5 if types == "sliding" else None
        cfg = tiny_config(tiny_target, layer_types=LAYER_TYPES[types], sliding_window=window)
        drafter = tiny_drafter(cfg)
        no_context = torch.zeros(0, cfg.num_context_layers * cfg.hidden_size)
        with torch.no_grad():
            base = drafter.draft(drafter.new_cache(), no_context, torch.tensor([5] + [TINY_MASK_ID] * 3))
            other = drafter.draft(drafter.new_cache(), no_context, torch.tensor([5, TINY_MASK_ID, TINY_MASK_ID, 7]))
        assert bool((other[:3] - base[:3]).abs().max() > 1e-4) is moves


def test_a_block_sees_only_earlier_context_of_its_sequence(tiny_target):
    cfg = tiny_config(tiny_target, layer_types=["full_attention"] * 2, sliding_window=None)
    drafter = tiny_drafter(cfg)
    context, input_ids, cu = packed_batch(cfg)
    anchors = torch.tensor([6, 15, 22])  # seq 0 = [0, 11), seq 1 = [11, 31)
    with torch.no_grad():
        base = drafter(context, input_ids, cu, anchors)

        def changed(ctx=None, ids=None):
            out = drafter(context if ctx is None else ctx, input_ids if ids is None else ids, cu, anchors)
            return (out - base).abs().amax(dim=(1, 2)) > 1e-5  # [A]: which blocks moved

        ctx = context.clone()
        ctx[15:] += 1.0  # at and after the anchor 15 (and everything of the block at 22)
        assert changed(ctx).tolist() == [False, False, True]
        ctx = context.clone()
        ctx[14] += 1.0  # just before the anchor 15, in sequence 1
        assert changed(ctx).tolist() == [False, True, True]
        ctx = context.clone()
        ctx[:6] += 1.0  # sequence 0 before its anchor: never seen by sequence 1
        assert changed(ctx).tolist() == [True, False, False]
        ids = input_ids.clone()
        ids[15] = (ids[15] + 1) % 256  # the token at one anchor: other blocks never see it
        assert changed(ids=ids).tolist() == [False, True, False]


def test_sliding_layer_caps_how_far_back_it_sees(tiny_target):
    cfg = tiny_config(tiny_target, layer_types=["sliding_attention"] * 2, sliding_window=3)
    drafter = tiny_drafter(cfg)
    context, input_ids, cu = packed_batch(cfg)
    anchors = torch.tensor([25])
    with torch.no_grad():
        base = drafter(context, input_ids, cu, anchors)
        ctx = context.clone()
        ctx[11:23] += 1.0  # local 0..11: further back than any block query's window reaches
        torch.testing.assert_close(drafter(ctx, input_ids, cu, anchors), base)
        ctx[24] += 1.0
        assert (drafter(ctx, input_ids, cu, anchors) - base).abs().max() > 1e-3


@pytest.mark.parametrize("window, causal, tile", [(None, False, 4), (None, False, 8), (5, False, 4), (2, False, 8),
                                                  (5, True, 4), (2, True, 8), (3, True, 16)])
def test_block_tables_equal_create_block_mask(window, causal, tile):
    cu = torch.tensor([0, 11, 31, 40])
    anchors = torch.tensor([0, 3, 6, 7, 11, 12, 18, 27, 31, 35])
    layout = BlockLayout.build(cu, anchors, 40, 4)
    q_len = len(anchors) * 4
    ours = layout.block_mask(window, causal, tile=tile)
    ref = create_block_mask(layout.mask_mod(window, causal), None, None, q_len, 40 + q_len, device="cpu", BLOCK_SIZE=tile)
    for a, b in ((ours.kv_num_blocks, ref.kv_num_blocks), (ours.full_kv_num_blocks, ref.full_kv_num_blocks)):
        assert torch.equal(a.flatten(), b.flatten())
    for n, ia, ib in ((ours.kv_num_blocks, ours.kv_indices, ref.kv_indices),
                      (ours.full_kv_num_blocks, ours.full_kv_indices, ref.full_kv_indices)):
        for row, count in enumerate(n.flatten().tolist()):
            assert torch.equal(ia[0, 0, row, :count], ib[0, 0, row, :count])
    assert ref.kv_num_blocks.sum() > 0
    if tile == 4 and window in (None, 5) and not causal:  # whole own-block tiles: the full-tile path is exercised
        assert ref.full_kv_num_blocks.sum() > 0


@pytest.mark.gpu
def test_compiled_flex_on_the_gpu_matches_the_dense_reference(tiny_target):
    """Blocks and gradients: the compiled flex kernel's backward against the hand-written reference's,
    every gradient finite (the padding rows of the last query tile see no key: a kernel option that
    drops the guard for such rows once made every gradient NaN)."""
    cfg = tiny_config(tiny_target)
    drafter = tiny_drafter(cfg)
    context, input_ids, cu = packed_batch(cfg)
    want = _reference(drafter, context, input_ids, cu, ANCHORS)
    want.sum().backward()
    want_grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    gpu = tiny_drafter(cfg).cuda()
    gpu.load_state_dict(drafter.state_dict())
    gpu.attach_frozen(drafter.embed_weight.cuda(), drafter.lm_head_weight.cuda())
    got = gpu(context.cuda(), input_ids.cuda(), cu.cuda(), torch.tensor(ANCHORS).cuda())
    got.sum().backward()
    torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=2e-3, atol=2e-3)
    for name, p in gpu.named_parameters():
        assert torch.isfinite(p.grad).all(), name
        rel = float((p.grad.cpu() - want_grads[name]).norm() / want_grads[name].norm().clamp(min=1e-12))
        assert rel < 1e-2, f"{name}: relative gradient difference {rel:.3g}"


@pytest.mark.gpu
def test_compiled_flex_without_grad_on_a_few_blocks(tiny_target):
    """Fewer than 128 query rows without grad (the last rounds of a path-tau replay in validation):
    inductor's flex-decoding kernel failed to compile here (NoValidChoicesError); the main kernel is
    forced, and it agrees with the CPU reference at every size, shapes varying as in a replay."""
    cfg = tiny_config(tiny_target)
    drafter = tiny_drafter(cfg)
    context, input_ids, cu = packed_batch(cfg)
    gpu = tiny_drafter(cfg).cuda()
    gpu.load_state_dict(drafter.state_dict())
    gpu.attach_frozen(drafter.embed_weight.cuda(), drafter.lm_head_weight.cuda())
    with torch.no_grad():
        for n in (len(ANCHORS), 3, 2, 1):
            anchors = torch.tensor(ANCHORS[:n])
            want = _reference(drafter, context, input_ids, cu, anchors.tolist())
            got = gpu(context.cuda(), input_ids.cuda(), cu.cuda(), anchors.cuda())
            torch.testing.assert_close(got.cpu(), want, rtol=2e-3, atol=2e-3)


def test_compiled_flex_matches_eager_and_stops_recompiling(tiny_target, monkeypatch):
    """The GPU path (torch.compile(flex_attention) with our BlockMask), run by inductor on the CPU:
    same output as eager, and new batch shapes stop causing compilations after the second one."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import dflash_common.drafter.attention as attention

    cfg = tiny_config(tiny_target)
    drafter = tiny_drafter(cfg)
    monkeypatch.setattr(attention, "FLEX_ON_CPU", True)
    torch._dynamo.reset()
    compiled = torch.compile(attention.flex_attention)
    graphs = []
    for lengths, anchors in (((11, 20), ANCHORS), ((13, 25, 9), [1, 4, 13, 20, 30, 38, 40]),
                             ((17, 30), [2, 5, 9, 20, 33, 40])):
        context, input_ids, cu = packed_batch(cfg, lengths)
        with torch.no_grad():
            monkeypatch.setattr(attention, "_flex_fn", lambda device: compiled)
            got = drafter(context, input_ids, cu, torch.tensor(anchors))
            monkeypatch.setattr(attention, "_flex_fn", lambda device: attention.flex_attention)
            want = drafter(context, input_ids, cu, torch.tensor(anchors))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[2] == graphs[1]  # the third shape reused the dynamic graphs
