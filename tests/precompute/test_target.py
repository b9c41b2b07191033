"""The truncated target: captured states equal the full model's hidden_states, and nothing after the
deepest captured layer is built or read."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_common.errors import UserError
from precompute import target as T


@pytest.fixture(scope="module")
def full_tiny(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def reference_states(full, ids):
    with torch.no_grad():
        return full(ids, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("layer_ids", [None, [0, 3, 6], [6, 2]])
def test_captured_states_equal_full_model_hidden_states(tiny_target, full_tiny, layer_ids):
    t = T.load_target(tiny_target, layer_ids, dtype="fp32")
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    got = t.forward(ids)
    want = reference_states(full_tiny, ids)
    expected_ids = layer_ids or [1, 2, 3, 4, 5]  # the DFlash rule for 8 layers
    assert t.layer_ids == expected_ids and len(got) == len(expected_ids)
    for layer_id, states in zip(expected_ids, got):
        assert states.shape == (2, 33, 64)
        torch.testing.assert_close(
            states, want[layer_id + 1], rtol=1e-5, atol=1e-5
        )  # id i = hidden_states[i+1]
        if layer_id > 0:
            assert not torch.allclose(states, want[layer_id], atol=1e-3)  # and not the layer before


def test_last_layer_is_captured_before_the_final_norm(tiny_target, full_tiny):
    """HF's hidden_states[N] is the normed output; id N-1 means the decoder layer's own output."""
    t = T.load_target(tiny_target, [7], dtype="fp32")
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    (got,) = t.forward(ids)
    seen = {}
    handle = full_tiny.model.layers[7].register_forward_hook(
        lambda m, a, o: seen.setdefault("out", o)
    )
    try:
        want = reference_states(full_tiny, ids)
    finally:
        handle.remove()
    torch.testing.assert_close(got, seen["out"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full_tiny.model.norm(got), want[8], rtol=1e-5, atol=1e-5)


def test_truncated_model_has_nothing_after_the_deepest_layer(tiny_target):
    t = T.load_target(tiny_target, [1, 3], dtype="fp32")
    names = [n for n, _ in t.model.named_parameters()]
    assert t.model.config.num_hidden_layers == 4 and len(t.model.layers) == 4
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {"0", "1", "2", "3"}
    assert not [n for n in names if "lm_head" in n or n.startswith("norm")]
    assert isinstance(t.model.norm, torch.nn.Identity)
    assert len(t.model.config.layer_types) == 4 and t.num_target_layers == 8


def test_unused_weights_are_never_read_from_disk(tiny_target, monkeypatch):
    """Record which checkpoint tensors the loader actually materialises."""
    import transformers.modeling_utils as mu

    read: set[str] = set()
    real_open = mu.safe_open

    class Slice:
        def __init__(self, key, inner):
            self.key, self.inner = key, inner

        def __getitem__(self, item):
            read.add(self.key)
            return self.inner[item]

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class File:
        def __init__(self, *a, **k):
            self.inner = real_open(*a, **k)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, key):
            return Slice(key, self.inner.get_slice(key))

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(mu, "safe_open", File)
    t = T.load_target(tiny_target, [1, 2], dtype="fp32")
    assert read, "the probe saw no tensor being read"
    assert not [k for k in read if "lm_head" in k or any(f"layers.{i}." in k for i in range(3, 8))]
    assert {f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)} <= read
    assert len(t.model.layers) == 3


def test_default_dtype_is_bf16(tiny_target):
    t = T.load_target(tiny_target, [1])
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}
    assert t.forward(torch.zeros(1, 5, dtype=torch.long))[0].dtype == torch.bfloat16


def test_truncated_config_cuts_every_per_layer_list(tiny_target):
    cfg = AutoConfig.from_pretrained(tiny_target)
    cfg.layer_types = ["sliding_attention", "full_attention"] * 4
    cut = T.truncated_config(cfg, 3)
    assert cut.num_hidden_layers == 3 and cut.layer_types == [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ]
    assert cfg.num_hidden_layers == 8 and len(cfg.layer_types) == 8  # the original is untouched


def test_user_errors(tiny_target, tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        T.load_target(tmp_path, None)
    with pytest.raises(UserError, match="target.layer_ids"):
        T.load_target(tiny_target, [8])
    with pytest.raises(UserError, match="list the layer ids explicitly"):
        T.resolve_layer_ids(None, 4)


def test_composite_checkpoint_loads_its_text_tower_truncated(tiny_vlm):
    path, full = tiny_vlm
    assert json.loads((path / "config.json").read_text())["architectures"] == [
        "Qwen3_5ForConditionalGeneration"
    ]
    t = T.load_target(path, [1, 4], dtype="fp32")
    assert len(t.model.layers) == 5 and t.model.config.layer_types[3] == "full_attention"
    assert not [n for n, _ in t.model.named_parameters() if "visual" in n or "lm_head" in n]
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = full.model.language_model(
            ids, output_hidden_states=True, use_cache=False
        ).hidden_states
    for layer_id, states in zip([1, 4], t.forward(ids)):
        torch.testing.assert_close(states, want[layer_id + 1], rtol=1e-5, atol=1e-5)


def test_compiled_decoder_layers_give_the_eager_states(tiny_target):
    """target.compile's regional compilation (every decoder layer's children; the capture hooks stay
    on the eager layers), by inductor on the CPU: the same states, also for a second batch shape."""
    import torch._dynamo

    eager = T.load_target(tiny_target, [1, 2], dtype="fp32")
    compiled = T.load_target(tiny_target, [1, 2], dtype="fp32", compile=True)  # ignored on a CPU...
    assert not any(
        hasattr(c, "_compiled_call_impl") and c._compiled_call_impl is not None
        for layer in T.decoder_layers(compiled.model)
        for c in layer.children()
    )
    torch._dynamo.reset()
    assert (
        T.compile_decoder_layers(compiled.model) == 3 * 4
    )  # ...and done by hand here: 3 layers x 4 parts
    g = torch.Generator().manual_seed(0)
    for shape in ((2, 33), (3, 20)):
        ids = torch.randint(0, 256, shape, generator=g)
        for got, want in zip(compiled.forward(ids), eager.forward(ids)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decoder_layers_are_found_inside_a_causal_lm(tiny_target):
    """Generation loads the target with its lm_head (a ...ForCausalLM around the base model): its
    layers are the base model's, and compiling them reaches every part."""
    causal = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    assert T.decoder_layers(causal) is causal.model.layers
    parts = sum(len(list(layer.children())) for layer in causal.model.layers)
    assert parts > 0 and T.compile_decoder_layers(causal) == parts


def test_generation_compiles_the_attention_by_its_parts(tiny_target):
    """With a KV cache the attention indexes it by its layer number, which torch.compile would
    specialise on (one graph per layer, the deeper ones uncompiled past the recompile limit): only
    its norms are compiled, every other part of a layer whole."""
    causal = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    layers = causal.model.layers
    count = T.compile_decoder_layers(causal, kv_cache=True)
    compiled = lambda m: m._compiled_call_impl is not None  # noqa: E731
    for layer in layers:
        assert (
            not compiled(layer.self_attn)
            and compiled(layer.self_attn.q_norm)
            and compiled(layer.self_attn.k_norm)
        )
        assert (
            not compiled(layer.self_attn.q_proj)
            and compiled(layer.mlp)
            and compiled(layer.input_layernorm)
        )
    assert count == len(layers) * (len(list(layers[0].children())) - 1 + 2)


@pytest.mark.gpu
def test_compiled_target_on_the_gpu_gives_the_eager_states(tiny_target):
    """In bf16 the compiled parts round otherwise than eager ones (fused kernels keep float32
    between ops): against the float32 states, the compiled target must be as close as the eager
    one."""
    ids = torch.randint(0, 256, (3, 300), generator=torch.Generator().manual_seed(0)).cuda()
    ref = T.load_target(tiny_target, None, dtype="fp32", device="cuda").forward(ids)
    eager = T.load_target(tiny_target, None, dtype="bf16", device="cuda").forward(ids)
    compiled = T.load_target(tiny_target, None, dtype="bf16", device="cuda", compile=True).forward(
        ids
    )
    for layer, (r, e, c) in enumerate(zip(ref, eager, compiled)):
        err_e, err_c = ((x.float() - r).norm() / r.norm() for x in (e, c))
        assert err_c <= 1.5 * err_e + 1e-3, (
            f"layer {layer}: compiled error {err_c:.3g}, eager {err_e:.3g}"
        )
