"""The drafter against the BRIEF's facts and against references computed another way: a per-block
dense-mask forward written from scratch here (transformers' own RoPE, explicit boolean masks,
plain softmax), create_block_mask's tile tables, and the KV-cache drafting path."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash_common.config import ConfigError
from dflash_common.drafter.model import BlockLayout, DrafterConfig

from drafter_testlib import TINY_MASK_ID, packed_batch, tiny_config, tiny_drafter

ANCHORS = [0, 3, 6, 7, 11, 12, 18, 27]  # seq 0 = [0, 11), seq 1 = [11, 31); includes both starts


# -- config --------------------------------------------------------------------------------------

QWEN3_8B = {  # Qwen3-8B's config.json fields that matter, as transformers 4 wrote them
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000,
    "rope_scaling": None, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151645,
}


def test_from_target_takes_shapes_rope_and_default_layer_ids():
    cfg = DrafterConfig.from_target(QWEN3_8B, mask_token_id=151669)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.num_target_layers) == (5, 16, 36)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4096, 32, 8, 128)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.vocab_size == 151936
    assert cfg.layer_types == ("full_attention",) * 5


def test_from_target_reads_transformers5_rope_parameters():
    t5 = {k: v for k, v in QWEN3_8B.items() if not k.startswith("rope")}
    t5["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                             "original_max_position_embeddings": 32768}
    cfg = DrafterConfig.from_target(t5, mask_token_id=151669, depth=3, layer_ids=[2, 5, 8])
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert DrafterConfig.from_config_json(cfg.to_config_json()) == cfg


def test_config_json_round_trip_and_pitfall_fields(tiny_target):
    cfg = tiny_config(tiny_target)
    data = cfg.to_config_json()
    assert DrafterConfig.from_config_json(json.loads(json.dumps(data))) == cfg
    assert data["architectures"] == ["DFlashDraftModel"] and data["model_type"] == "qwen3"
    assert data["block_size"] == 4 and data["num_target_layers"] == 8 and data["num_hidden_layers"] == 2
    assert data["dflash_config"]["mask_token_id"] == TINY_MASK_ID
    assert data["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]
    assert data["rope_theta"] == 10000.0 and data["rope_parameters"]["rope_theta"] == 10000.0
    assert data["use_sliding_window"] is True and data["sliding_window"] == 5
    # mixed layers: no global causality key (vLLM's is_causal / dflash_config.causal override every
    # layer); the engines' layer_types rule gives sliding causal, full bidirectional, as trained
    assert "causal" not in data["dflash_config"] and "is_causal" not in data
    assert cfg.layer_causality() == (True, False)
    with pytest.raises(ConfigError, match="causal full_attention"):
        DrafterConfig.from_config_json({**data, "is_causal": True})


@pytest.mark.parametrize("layer_types, causal", [(["full_attention"] * 2, False), (["sliding_attention"] * 2, True)])
def test_one_causality_for_all_layers_is_written_where_vllm_reads_it(tiny_target, layer_types, causal):
    window = 5 if causal else None
    data = tiny_config(tiny_target, layer_types=layer_types, sliding_window=window).to_config_json()
    assert data["is_causal"] is causal and data["dflash_config"]["causal"] is causal


def test_an_old_bidirectional_sliding_checkpoint_reads_as_such(tiny_target):
    data = tiny_config(tiny_target).to_config_json()
    old = {**data, "is_causal": False, "dflash_config": {**data["dflash_config"], "causal": False}}
    cfg = DrafterConfig.from_config_json(old)
    assert cfg.sliding_causal is False and cfg.layer_causality() == (False, False)


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=None), "sliding_window is not set"),
    (dict(mask_token_id=320), "mask_token_id = 320"),
    (dict(layer_ids=[1, 8]), "outside"),
])
def test_bad_drafter_options_name_the_field(tiny_target, change, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tiny_target, **change)


def test_rope_is_the_targets_own_including_scaling():
    from transformers import Qwen3Config

    from dflash_common.drafter.model import Rotary

    target = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=320,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 123456.0, "factor": 4.0,
                                          "original_max_position_embeddings": 512})
    cfg = DrafterConfig.from_target(target, mask_token_id=TINY_MASK_ID, depth=1)
    positions = torch.tensor([0, 1, 7, 300, 2047])
    cos, sin = Qwen3RotaryEmbedding(target)(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = Rotary(cfg)(positions)
    torch.testing.assert_close(ours[0], cos[0])
    torch.testing.assert_close(ours[1], sin[0])
    assert Rotary(cfg).scaling != 1.0  # yarn's attention factor is applied, not dropped


# -- parameters: released names, frozen parts outside ---------------------------------------------


def test_frozen_embedding_and_lm_head_are_not_state_and_get_no_gradient(tiny_target):
    cfg = tiny_config(tiny_target)
    drafter = tiny_drafter(cfg)
    state = drafter.state_dict()
    assert not any("embed" in k or "lm_head" in k for k in state)
    frozen_ptrs = {drafter.embed_weight.data_ptr(), drafter.lm_head_weight.data_ptr()}
    assert not frozen_ptrs & {p.data_ptr() for p in drafter.parameters()}
    assert list(state) == [n for n, _ in drafter.named_parameters()]  # no buffers either
    context, input_ids, cu = packed_batch(cfg)
    hidden = drafter(context, input_ids, cu, torch.tensor(ANCHORS))
    (hidden.float() @ drafter.lm_head_weight.T).logsumexp(-1).sum().backward()
    assert drafter.embed_weight.grad is None and drafter.lm_head_weight.grad is None
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())


# -- training forward vs an independent dense reference -----------------------------------------


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
    import dflash_common.drafter.model as drafter_module

    window = 5 if "sliding_attention" in LAYER_TYPES[types] else None
    cfg = tiny_config(tiny_target, layer_types=LAYER_TYPES[types], sliding_window=window)
    drafter = tiny_drafter(cfg)
    context, input_ids, cu = packed_batch(cfg)
    grad = path.endswith("with-grad")
    monkeypatch.setattr(drafter_module, "FLEX_ON_CPU", path.startswith("flex"))
    if path == "chunked-one-row-a-time":
        monkeypatch.setattr(drafter_module, "_CPU_SCORES_PER_CHUNK", 1)
    if path == "chunked-few-rows":  # chunks that end inside a block and span two sequences
        monkeypatch.setattr(drafter_module, "_CPU_ROWS_PER_CHUNK", 5)
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
        windows = [cfg.window(i) for i in range(cfg.num_hidden_layers)]
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


# -- speculative decoding with a KV cache --------------------------------------------------------


def test_drafting_with_the_cache_equals_the_training_forward(tiny_target):
    cfg = tiny_config(tiny_target)
    drafter = tiny_drafter(cfg)
    context, input_ids, cu = packed_batch(cfg)
    anchors = torch.tensor([13, 23])  # sequence 1 starts at 11: local anchors 2 and 12
    with torch.no_grad():
        want = drafter(context, input_ids, cu, anchors)
        seq_ctx, seq_ids = context[11:], input_ids[11:]
        mask = [TINY_MASK_ID] * (cfg.block_size - 1)
        cache = drafter.new_cache()
        first = drafter.draft(cache, seq_ctx[:2], torch.tensor([int(seq_ids[2])] + mask))
        assert cache.length == 2  # the block's keys/values were not kept
        torch.testing.assert_close(first, want[0], rtol=1e-4, atol=1e-4)
        drafter.draft(cache, seq_ctx[2:7], torch.tensor([int(seq_ids[7])] + mask))  # a rejected draft
        second = drafter.draft(cache, seq_ctx[7:12], torch.tensor([int(seq_ids[12])] + mask))
        assert cache.length == 12
        torch.testing.assert_close(second, want[1], rtol=1e-4, atol=1e-4)
        logits = drafter.logits(second)
        assert logits.shape == (cfg.block_size, cfg.vocab_size)
        cache.keys, cache.values = [k[:7] for k in cache.keys], [v[:7] for v in cache.values]
        tokens = drafter.greedy_draft(cache, seq_ctx[7:12], int(seq_ids[12]))
        assert torch.equal(tokens, logits[1:].argmax(-1)) and cache.length == 12


def test_reads_a_released_z_lab_style_config():
    released = {  # the layout of z-lab's released Qwen3 drafters (transformers 4.57 wrote it)
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False, "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
        "layer_types": ["full_attention"] * 3, "max_position_embeddings": 40960, "num_attention_heads": 16,
        "num_hidden_layers": 3, "num_key_value_heads": 8, "num_target_layers": 36, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "use_sliding_window": False, "vocab_size": 151936,
    }
    cfg = DrafterConfig.from_config_json(released)
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_hidden_layers, cfg.rope_theta) == (16, 151669, 3, 1e6)
    written = cfg.to_config_json()
    assert all(written[k] == v for k, v in released.items() if k != "dflash_config"), "a field changed"
    # all full layers: bidirectional said explicitly, where vLLM reads it first
    assert written["dflash_config"] == {**released["dflash_config"], "causal": False}
    del released["num_target_layers"]
    with pytest.raises(ConfigError, match="num_target_layers"):
        DrafterConfig.from_config_json(released)


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

    import dflash_common.drafter.model as drafter_module

    cfg = tiny_config(tiny_target)
    drafter = tiny_drafter(cfg)
    monkeypatch.setattr(drafter_module, "FLEX_ON_CPU", True)
    torch._dynamo.reset()
    compiled = torch.compile(drafter_module.flex_attention)
    graphs = []
    for lengths, anchors in (((11, 20), ANCHORS), ((13, 25, 9), [1, 4, 13, 20, 30, 38, 40]),
                             ((17, 30), [2, 5, 9, 20, 33, 40])):
        context, input_ids, cu = packed_batch(cfg, lengths)
        with torch.no_grad():
            monkeypatch.setattr(drafter_module, "_flex_fn", lambda device: compiled)
            got = drafter(context, input_ids, cu, torch.tensor(anchors))
            monkeypatch.setattr(drafter_module, "_flex_fn", lambda device: drafter_module.flex_attention)
            want = drafter(context, input_ids, cu, torch.tensor(anchors))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[2] == graphs[1]  # the third shape reused the dynamic graphs


def test_a_few_steps_on_one_batch_fit_it(tiny_target):
    """Drafter, objective and fused loss together: the training signal reaches every part."""
    from dflash_common.drafter.loss import fused_lm_head_loss
    from dflash_common.drafter.objective import AcceptanceCounts, block_labels, sample_anchors

    cfg = tiny_config(tiny_target)
    drafter = tiny_drafter(cfg)
    context, input_ids, cu = packed_batch(cfg)
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    anchors = sample_anchors(loss_mask, cu, cfg.block_size, 6, torch.Generator().manual_seed(0))
    labels, weights = block_labels(input_ids, loss_mask, cu, anchors, cfg.block_size)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(25):
        hidden = drafter(context, input_ids, cu, anchors)
        out = fused_lm_head_loss(hidden.flatten(0, 1), drafter.lm_head_weight, labels.flatten(), weights.flatten())
        (out.loss / weights.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item() / weights.sum().item())
    counts = AcceptanceCounts.from_blocks(out.correct.view_as(labels), weights > 0)
    assert losses[-1] < 0.3 * losses[0]
    assert counts.tau > 2.0


def _forward_and_grads(drafter, batch):
    context, input_ids, cu, anchors = batch
    drafter.zero_grad(set_to_none=True)
    hidden = drafter(context, input_ids, cu, anchors)
    (hidden.float() @ drafter.lm_head_weight.float().T).logsumexp(-1).sum().backward()
    return hidden.detach().float(), {n: p.grad.detach().float().clone() for n, p in drafter.named_parameters()}


def test_compiled_regions_give_the_eager_forward_and_gradients(tiny_target):
    """precision.compile's regions (queries, context keys/values, norms, MLP: drafter.compile_regions),
    compiled by inductor on the CPU: the same blocks and gradients as eager, over two batch shapes (the
    second through the dynamic graphs); weight names and the state dict unchanged."""
    import torch._dynamo

    cfg = tiny_config(tiny_target)
    eager, compiled = tiny_drafter(cfg), tiny_drafter(cfg)
    compiled.load_state_dict(eager.state_dict())
    compiled.attach_frozen(eager.embed_weight, eager.lm_head_weight)
    torch._dynamo.reset()
    compiled.compile_regions()
    assert list(compiled.state_dict()) == list(eager.state_dict())
    for lengths, anchors in (((11, 20), ANCHORS), ((13, 25, 9), [1, 4, 13, 20, 30, 38, 40])):
        context, input_ids, cu = packed_batch(cfg, lengths)
        batch = (context, input_ids, cu, torch.tensor(anchors))
        want, want_grads = _forward_and_grads(eager, batch)
        got, got_grads = _forward_and_grads(compiled, batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for name, g in want_grads.items():
            rel = float((got_grads[name] - g).norm() / g.norm().clamp(min=1e-12))
            assert rel < 1e-4, f"{name}: relative gradient difference {rel:.3g}"


@pytest.mark.gpu
def test_compiled_regions_on_the_gpu_match_eager_under_autocast(tiny_target):
    """Under bf16 autocast the compiled regions round otherwise than eager ops: against float32 (no
    autocast), their blocks and gradients must be as close as eager's."""
    cfg = tiny_config(tiny_target)
    eager = tiny_drafter(cfg)
    context, input_ids, cu = packed_batch(cfg)
    batch = (context.cuda(), input_ids.cuda(), cu.cuda(), torch.tensor(ANCHORS).cuda())
    results = {}
    for name, compile_, autocast in (("fp32", False, False), ("eager", False, True), ("compiled", True, True)):
        d = tiny_drafter(cfg).cuda()
        d.load_state_dict(eager.state_dict())
        d.attach_frozen(eager.embed_weight.cuda(), eager.lm_head_weight.cuda())
        if compile_:
            d.compile_regions()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            results[name] = _forward_and_grads(d, batch)

    def err(name, grad=None):
        got, ref = (results[name][0], results["fp32"][0]) if grad is None else \
            (results[name][1][grad], results["fp32"][1][grad])
        return float((got - ref).norm() / ref.norm().clamp(min=1e-12))

    assert err("compiled") <= 1.5 * err("eager") + 1e-3, (err("compiled"), err("eager"))
    for grad in results["fp32"][1]:
        assert err("compiled", grad) <= 1.5 * err("eager", grad) + 1e-3, (grad, err("compiled", grad), err("eager", grad))
