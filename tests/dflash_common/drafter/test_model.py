"""The drafter's modules against the BRIEF's facts and against other ways to compute the same: the
target's own RoPE, frozen parts outside the state, the KV-cache drafting path against the training
forward, a few training steps, and the compiled regions against eager."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_common.drafter.config import DrafterConfig

from drafter_testlib import ANCHORS, TINY_MASK_ID, packed_batch, tiny_config, tiny_drafter


def test_rope_is_the_targets_own_including_scaling():
    from transformers import Qwen3Config

    from dflash_common.drafter.model import Rotary

    target = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=320,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 123456.0,
            "factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    )
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
        # a rejected draft
        drafter.draft(cache, seq_ctx[2:7], torch.tensor([int(seq_ids[7])] + mask))
        second = drafter.draft(cache, seq_ctx[7:12], torch.tensor([int(seq_ids[12])] + mask))
        assert cache.length == 12
        torch.testing.assert_close(second, want[1], rtol=1e-4, atol=1e-4)
        logits = drafter.logits(second)
        assert logits.shape == (cfg.block_size, cfg.vocab_size)
        cache.keys, cache.values = [k[:7] for k in cache.keys], [v[:7] for v in cache.values]
        tokens = drafter.greedy_draft(cache, seq_ctx[7:12], int(seq_ids[12]))
        assert torch.equal(tokens, logits[1:].argmax(-1)) and cache.length == 12


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
        out = fused_lm_head_loss(
            hidden.flatten(0, 1), drafter.lm_head_weight, labels.flatten(), weights.flatten()
        )
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
    return hidden.detach().float(), {
        n: p.grad.detach().float().clone() for n, p in drafter.named_parameters()
    }


def test_compiled_regions_give_the_eager_forward_and_gradients(tiny_target):
    """precision.compile's regions (queries, context keys/values, norms, MLP:
    drafter.compile_regions), compiled by inductor on the CPU: the same blocks and gradients as
    eager, over two batch shapes (the second through the dynamic graphs); weight names and the state
    dict unchanged."""
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
    for name, compile_, autocast in (
        ("fp32", False, False),
        ("eager", False, True),
        ("compiled", True, True),
    ):
        d = tiny_drafter(cfg).cuda()
        d.load_state_dict(eager.state_dict())
        d.attach_frozen(eager.embed_weight.cuda(), eager.lm_head_weight.cuda())
        if compile_:
            d.compile_regions()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            results[name] = _forward_and_grads(d, batch)

    def err(name, grad=None):
        got, ref = (
            (results[name][0], results["fp32"][0])
            if grad is None
            else (results[name][1][grad], results["fp32"][1][grad])
        )
        return float((got - ref).norm() / ref.norm().clamp(min=1e-12))

    assert err("compiled") <= 1.5 * err("eager") + 1e-3, (err("compiled"), err("eager"))
    for grad in results["fp32"][1]:
        assert err("compiled", grad) <= 1.5 * err("eager", grad) + 1e-3, (
            grad,
            err("compiled", grad),
            err("eager", grad),
        )
