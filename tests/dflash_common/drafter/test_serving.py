"""The export lint against each loader's rules (dflash_common/drafter/serving.py): our own exports
read back as trained by both loaders, and each way a config or weight file can be read differently
is named. The rules themselves are checked against vLLM's code in tests/test_serving_vllm.py."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_common.errors import UserError
from dflash_common.drafter import serving
from dflash_common.drafter.export import export, save_drafter

from drafter_testlib import tiny_config, tiny_drafter

TYPES = {"mixed": ["sliding_attention", "full_attention"], "sliding": ["sliding_attention"] * 2,
         "full": ["full_attention"] * 2}


def _cfg(tiny_target, types="mixed", **over):
    window = 5 if "sliding_attention" in TYPES[types] else None
    return tiny_config(tiny_target, layer_types=TYPES[types], sliding_window=window, **over)


@pytest.mark.parametrize("types", sorted(TYPES))
def test_our_exports_read_back_as_trained_by_both_loaders(tiny_target, types):
    cfg = _cfg(tiny_target, types)
    found = serving.lint_config(cfg, cfg.to_config_json())
    assert serving.errors(found) == []
    v2 = [f for f in found if "VLLM_USE_V2_MODEL_RUNNER" in f.message]
    assert bool(v2) is (types == "mixed")
    config = cfg.to_config_json()
    for i in range(2):  # each loader's reading, layer by layer, is the trained rule
        assert serving.vllm_layer_causal(config, i) == serving.sglang_layer_causal(config, i) == cfg.causal(i)


def _errors(cfg, config):
    return [str(f) for f in serving.errors(serving.lint_config(cfg, config))]


def test_each_misreading_is_named(tiny_target):
    cfg = _cfg(tiny_target, "full")
    good = cfg.to_config_json()
    no_theta = {k: v for k, v in good.items() if k not in ("rope_theta",)}
    assert any("sglang: top-level rope_theta is None" in e for e in _errors(cfg, no_theta))
    wrong_theta = {**good, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert any(e.startswith("vllm: rope_parameters.rope_theta") for e in _errors(cfg, wrong_theta))
    aux = {**good, "eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4, 5]}  # vLLM reads these first, in +1 units
    assert _errors(cfg, aux) == ["vllm: would feed target layers [0, 1, 2, 3, 4], trained on [1, 2, 3, 4, 5]."]
    no_ids = {**good, "dflash_config": {"mask_token_id": cfg.mask_token_id}}
    assert any(e.startswith("sglang: would feed target layers [1, 5]") for e in _errors(cfg, no_ids))
    causal = {**good, "is_causal": True}
    assert sorted(e.split(":")[0] for e in _errors(cfg, causal)) == ["vllm"]
    no_block = {k: v for k, v in good.items() if k != "block_size"}
    assert _errors(cfg, no_block) == ["sglang: would read block_size 16, trained 4."]
    no_mask = {**good, "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids)}}
    assert any("mask_token_id" in e for e in _errors(cfg, no_mask))


def test_sliding_window_and_its_sglang_reading(tiny_target):
    cfg = _cfg(tiny_target, "sliding")
    config = cfg.to_config_json()
    assert serving.vllm_sliding_window(config, 0) == serving.sglang_sliding_window(config, 0) == 5
    override = {**config, "dflash_config": {**config["dflash_config"], "swa_window_size": 7}}
    assert _errors(cfg, override) == ["vllm: would read sliding windows [7, 7], trained [5, 5]."]


def test_an_old_bidirectional_sliding_drafter_is_refused_and_nothing_written(tiny_target, tmp_path):
    cfg = _cfg(tiny_target, "mixed", )
    import dataclasses

    old = dataclasses.replace(cfg, sliding_causal=False)  # trained bidirectionally: SGLang reads it causal
    src = save_drafter(tiny_drafter(old), tmp_path / "old", torch.float32)
    with pytest.raises(UserError, match="sglang: would run the block's attention with causal"):
        export(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_weights_a_loader_would_skip_or_leave_uninitialised():
    expected = {"fc.weight": (4, 8), "norm.weight": (4,)}
    found = {"fc.weight": (4, 8), "model.norm.weights": (4,)}
    msgs = [str(f) for f in serving.lint_weights(expected, found)]
    assert msgs == ["sglang: would skip unknown weights silently: model.norm.weights",
                    "both: would leave missing weights uninitialised: norm.weight"]


def test_commands_say_b_minus_1_for_vllm_and_b_for_sglang(tiny_target):
    cmds = serving.serve_commands(_cfg(tiny_target, "mixed"), "/d", "/t")
    assert cmds["vllm"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve /t --speculative-config ")
    assert json.loads(cmds["vllm"].split("--speculative-config ")[1].strip("'"))["num_speculative_tokens"] == 3
    assert cmds["sglang"].endswith("--speculative-draft-model-path /d --speculative-num-draft-tokens 4")
    assert "VLLM_USE" not in serving.serve_commands(_cfg(tiny_target, "full"), "/d")["vllm"]


def test_lint_drafter_dir_reads_what_lies_on_disk(tiny_target, tmp_path):
    from safetensors.torch import load_file, save_file

    out = save_drafter(tiny_drafter(_cfg(tiny_target, "full")), tmp_path / "d", torch.float32)
    assert serving.errors(serving.lint_drafter_dir(out)) == []
    weights = load_file(str(out / "model.safetensors"))
    weights["layers.0.mlp.gate.weight"] = weights.pop("layers.0.mlp.gate_proj.weight")
    save_file(weights, str(out / "model.safetensors"))
    assert len(serving.errors(serving.lint_drafter_dir(out))) == 2
