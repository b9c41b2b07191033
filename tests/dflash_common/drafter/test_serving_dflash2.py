"""The export of a DFlash2 drafter and its lint (serving_dflash2.py): what dflash-export writes
reads back as trained, and each way vLLM 0.32 or SGLang would load a DFlash2 checkpoint otherwise
than it looks (a key missing, `.weight` codebooks, a tensor missing, base_kernel stored [T, 2, H])
is named. vLLM's own loader on these cases: tests/test_serving_vllm_dflash2.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_common.drafter import serving
from dflash_common.drafter.export import export, load_drafter, save_drafter
from dflash_common.errors import UserError

from drafter_testlib import randomise_dflash2, tiny_config, tiny_drafter

D2 = dict(selector_rank=8, selector_top_k=4)


@pytest.fixture()
def exported(tiny_target, tmp_path):
    """A DFlash2 drafter as a run's checkpoint holds it (float32), exported by dflash-export."""
    cfg = tiny_config(
        tiny_target, arch="dflash2", layer_types=["full_attention"] * 2, sliding_window=None, **D2
    )
    drafter = randomise_dflash2(tiny_drafter(cfg))  # trained-like: tap 0 dominant on both sides
    save_drafter(drafter, tmp_path / "run-drafter", dtype=torch.float32)
    return cfg, export(tmp_path / "run-drafter", tmp_path / "export")


def _lint(path):
    return [str(f) for f in serving.errors(serving.lint_drafter_dir(path))]


def test_the_export_is_the_released_layout_and_lints_clean(exported):
    cfg, out = exported
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert weights["candidate_selector.predecessor_codebook"].shape == (cfg.vocab_size, 8)
    assert weights["layers.1.mlp_conv.base_kernel"].dtype == torch.bfloat16
    assert _lint(out) == []
    warnings = [str(f) for f in serving.lint_drafter_dir(out)]
    assert any("VLLM_USE_V2_MODEL_RUNNER=1" in w for w in warnings)
    assert serving.serve_commands(cfg, str(out))["vllm"].startswith(
        "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve"
    )
    drafter, back = load_drafter(out)
    assert back == cfg and type(drafter).__name__ == "DFlash2Drafter"


def _rewrite(out, change):
    weights = load_file(str(out / "model.safetensors"))
    change(weights)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def test_weight_codebooks_are_named_and_refused(exported):
    _, out = exported

    def suffix(w):
        w["candidate_selector.successor_codebook.weight"] = w.pop(
            "candidate_selector.successor_codebook"
        )

    _rewrite(out, suffix)
    errors = _lint(out)
    assert any("bare parameters" in e and "successor_codebook.weight" in e for e in errors)
    assert any("missing" in e and "candidate_selector.successor_codebook" in e for e in errors)
    with pytest.raises(UserError, match="rename \\*_codebook.weight"):
        load_drafter(out)


def test_a_missing_tensor_is_refused_though_vllm_would_load_it(exported):
    _, out = exported
    _rewrite(out, lambda w: w.pop("layers.1.mlp_conv.base_kernel"))
    assert any("uninitialised" in e and "layers.1.mlp_conv.base_kernel" in e for e in _lint(out))


def test_a_base_kernel_stored_taps_first_is_caught_though_its_shape_is_right(exported):
    _, out = exported

    def transpose(w):
        w["layers.0.attention_conv.base_kernel"] = (
            w["layers.0.attention_conv.base_kernel"].transpose(0, 1).contiguous()
        )

    assert _lint(out) == []
    _rewrite(out, transpose)
    assert any("layers.0.attention_conv.base_kernel" in e and "[T, 2, H]" in e for e in _lint(out))


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda c: c["dflash_config"].pop("conv_group_size"),
            "vllm: dflash_config.conv_group_size is missing",
        ),
        (lambda c: c["dflash_config"].update(selector_top_k=8), "selector_top_k is 8, trained 4"),
        (
            lambda c: c["dflash_config"].update(input_embedding_scale=2.0),
            "input_embedding_scale must be 1",
        ),
        (
            lambda c: c["dflash_config"].update(sample_from_anchor=True),
            "sample_from_anchor must be false",
        ),
        (
            lambda c: c.update(architectures=["DFlashDraftModel"]),
            "architectures must be ['DFlash2DraftModel']",
        ),
    ],
)
def test_each_config_misreading_is_named(exported, change, match):
    cfg, out = exported
    config = json.loads((out / "config.json").read_text())
    change(config)
    found = [str(f) for f in serving.errors(serving.lint_config(cfg, config))]
    assert any(match in f for f in found), found
