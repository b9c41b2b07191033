"""dflash-export of a DSpark drafter: the layout vLLM 0.32 loads (config keys, weight names and
shapes, read back to the same drafter), and the export lint against vLLM's DSpark loader rules: what
the loader refuses, and what it would load silently wrong (missing Markov weights, a missing
confidence flag)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_common.drafter import serving
from dflash_common.drafter.export import export, load_drafter, save_drafter
from dflash_common.errors import UserError

from test_dspark import RANK, dspark_config, dspark_drafter


@pytest.fixture()
def exported(tiny_target, tmp_path):
    drafter = dspark_drafter(dspark_config(tiny_target))
    save_drafter(drafter, tmp_path / "run-drafter", dtype=torch.float32)
    return drafter, export(tmp_path / "run-drafter", tmp_path / "export", dtype=torch.float32)


def test_export_writes_vllms_layout_and_reads_back_the_same_drafter(exported):
    drafter, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == RANK
    with safe_open(out / "model.safetensors", framework="pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert shapes["markov_head.markov_w2.weight"] == (drafter.cfg.vocab_size, RANK)
    assert not any(n.startswith(("model.", "embed_tokens", "lm_head")) for n in shapes)
    back, cfg = load_drafter(out)
    assert cfg == drafter.cfg and type(back) is type(drafter)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in drafter.state_dict().items())
    assert serving.lint_drafter_dir(out) == []
    commands = serving.serve_commands(cfg, str(out))
    assert (
        '"method": "dspark"' in commands["vllm"]
        and '"num_speculative_tokens": 4' in commands["vllm"]
    )


def _break(out, kind):
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    if kind == "no-markov-weights":
        weights = {k: v for k, v in weights.items() if not k.startswith("markov_head.")}
    elif kind == "markov-w2-transposed":
        weights["markov_head.markov_w2.weight"] = weights[
            "markov_head.markov_w2.weight"
        ].T.contiguous()
    elif kind == "no-confidence-flags":
        config.pop("enable_confidence_head")
        config.pop("confidence_head_with_markov")
    elif kind == "anchor-not-a-prediction":
        config["sample_from_anchor"] = False
    elif kind == "ids-in-dflash-config-differ":
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["target_layer_ids"]]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "kind,finding",
    [
        ("no-markov-weights", "without these weights"),
        ("markov-w2-transposed", "wrong shape"),
        ("ids-in-dflash-config-differ", "top-level target_layer_ids reads"),
    ],
)
def test_the_lint_names_what_vllm_would_refuse_or_load_wrong(exported, kind, finding):
    _, out = exported
    _break(out, kind)
    found = [str(f) for f in serving.errors(serving.lint_drafter_dir(out))]
    assert any(finding in f for f in found), found


def test_the_lint_reads_flags_as_vllm_does(tiny_target):
    """A config without the confidence flags reads as a drafter without a head (vLLM's defaults),
    which is not the drafter trained; lint_config names the flags."""
    cfg = dspark_config(tiny_target)
    config = cfg.to_config_json()
    for key in ("enable_confidence_head", "confidence_head_with_markov"):
        broken = {k: v for k, v in config.items() if k != key}
        assert any(key in f.message for f in serving.lint_config(cfg, broken))
    assert any(
        "sample_from_anchor" in f.message
        for f in serving.lint_config(cfg, {**config, "sample_from_anchor": False})
    )
    assert any(
        "markov_rank" in f.message
        for f in serving.lint_config(cfg, {**config, "markov_rank": RANK * 2})
    )
    assert serving.lint_config(cfg, config) == []


def test_loading_a_dspark_export_without_its_markov_weights_is_refused(exported):
    _, out = exported
    _break(out, "no-markov-weights")
    with pytest.raises(UserError, match="missing: markov_head.markov_w1.weight"):
        load_drafter(out)
