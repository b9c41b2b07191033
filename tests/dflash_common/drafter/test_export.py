"""Export/import in the released layout: names and shapes checked against a list written out here
from the config, the BRIEF's config.json pitfalls, identical outputs after re-import, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_common.errors import UserError
from dflash_common.drafter.export import (
    export, load_drafter, load_weights_into, main, resolve_drafter_dir, save_drafter,
)

from drafter_testlib import TINY_MASK_ID, packed_batch, tiny_config, tiny_drafter

ROOT = Path(__file__).resolve().parents[3]


def _expected_layout(h=64, i=128, heads=4, kv_heads=2, d=16, k=5, depth=2):
    """Every weight name and shape of the released layout, written out by hand."""
    names = {"fc.weight": (h, k * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(depth):
        names |= {
            f"layers.{n}.self_attn.q_proj.weight": (heads * d, h),
            f"layers.{n}.self_attn.k_proj.weight": (kv_heads * d, h),
            f"layers.{n}.self_attn.v_proj.weight": (kv_heads * d, h),
            f"layers.{n}.self_attn.o_proj.weight": (h, heads * d),
            f"layers.{n}.self_attn.q_norm.weight": (d,),
            f"layers.{n}.self_attn.k_norm.weight": (d,),
            f"layers.{n}.mlp.gate_proj.weight": (i, h),
            f"layers.{n}.mlp.up_proj.weight": (i, h),
            f"layers.{n}.mlp.down_proj.weight": (h, i),
            f"layers.{n}.input_layernorm.weight": (h,),
            f"layers.{n}.post_attention_layernorm.weight": (h,),
        }
    return names


def _checkpoint(run: Path, step: int, drafter, complete: bool = True) -> Path:
    """A training checkpoint as the trainer writes it: step-N/drafter/ (float32), then COMPLETE."""
    step_dir = run / f"step-{step}"
    save_drafter(drafter, step_dir / "drafter")
    if complete:
        (step_dir / "COMPLETE").write_text("")
    return step_dir


@pytest.fixture
def drafter(tiny_target):
    return tiny_drafter(tiny_config(tiny_target))  # depth 2, layer 0 sliding


def test_exported_names_shapes_and_dtypes_are_the_released_layout(drafter, tmp_path):
    _checkpoint(tmp_path / "run", 10, drafter)
    out = export(tmp_path / "run", tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(out / "model.safetensors", framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        metadata = f.metadata()
    # format "pt" as transformers expects; the config it was saved with, which loaders of ours check
    assert metadata.keys() == {"format", "dflash_config_json"} and metadata["format"] == "pt"
    assert json.loads(metadata["dflash_config_json"]) == json.loads((out / "config.json").read_text())
    assert shapes == _expected_layout()
    assert dtypes == {"BF16"}


def test_config_json_carries_the_pitfall_fields(drafter, tmp_path):
    out = save_drafter(drafter, tmp_path / "d", torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 4 and config["num_target_layers"] == 8  # top-level
    # sliding layer 0 causal, full layer 1 bidirectional: no global key, the layer_types rule says it
    assert config["dflash_config"] == {"mask_token_id": TINY_MASK_ID, "target_layer_ids": [1, 2, 3, 4, 5]}
    assert config["rope_theta"] == 10000.0 and "rope_scaling" in config  # written by hand, top-level
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 320 and config["hidden_size"] == 64
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 5
    assert config["dtype"] == "bfloat16"


def test_reimport_gives_identical_outputs(drafter, tmp_path):
    context, input_ids, cu = packed_batch(drafter.cfg)
    anchors = torch.tensor([2, 5, 12, 20])
    with torch.no_grad():
        want = drafter(context, input_ids, cu, anchors)
    step = _checkpoint(tmp_path / "run", 3, drafter)
    for source in (tmp_path / "run", step, step / "drafter"):
        loaded, cfg = load_drafter(source)
        assert cfg == drafter.cfg
        loaded.attach_frozen(drafter.embed_weight, drafter.lm_head_weight)
        with torch.no_grad():
            assert torch.equal(loaded(context, input_ids, cu, anchors), want)


def test_newest_complete_step_is_exported(drafter, tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, 5, drafter)
    _checkpoint(run, 12, drafter)
    newer = tiny_drafter(drafter.cfg, seed=7)
    _checkpoint(run, 30, newer, complete=False)  # being written: must not count
    assert resolve_drafter_dir(run) == run / "step-12" / "drafter"
    with pytest.raises(UserError, match="incomplete"):
        resolve_drafter_dir(run / "step-30")
    with pytest.raises(UserError, match="no complete checkpoint"):
        resolve_drafter_dir(_checkpoint(tmp_path / "run2", 1, drafter, complete=False).parent)
    # a run with its final drafter/ beside the steps: steps still decide; alone, the final one serves
    save_drafter(newer, run / "drafter")
    assert resolve_drafter_dir(run) == run / "step-12" / "drafter"
    final_only = tmp_path / "run3"
    save_drafter(newer, final_only / "drafter")
    assert resolve_drafter_dir(final_only) == final_only / "drafter"


def test_unknown_missing_or_misshapen_weights_are_refused(drafter, tmp_path):
    good = save_drafter(drafter, tmp_path / "good")
    weights = load_file(good / "model.safetensors")
    cases = {
        "unknown: embed_tokens.weight": {**weights, "embed_tokens.weight": torch.zeros(320, 64)},
        "missing: norm.weight": {k: v for k, v in weights.items() if k != "norm.weight"},
        "wrong shape": {**weights, "fc.weight": torch.zeros(64, 64)},
    }
    for message, tensors in cases.items():
        bad = tmp_path / message.split(":")[0].replace(" ", "-")
        bad.mkdir()
        (bad / "config.json").write_text((good / "config.json").read_text())
        save_file(tensors, str(bad / "model.safetensors"))
        with pytest.raises(UserError, match=message):
            load_drafter(bad)


def test_a_released_drafter_initialises_training_weights(drafter, tiny_target, tmp_path):
    released = save_drafter(drafter, tmp_path / "released", torch.bfloat16)
    fresh = tiny_drafter(drafter.cfg, seed=5)
    load_weights_into(fresh, released)
    assert fresh.fc.weight.dtype == torch.float32
    torch.testing.assert_close(fresh.fc.weight, drafter.fc.weight.bfloat16().float())
    other = tiny_drafter(tiny_config(tiny_target, layer_ids=[1, 3, 5, 6, 7]))
    with pytest.raises(UserError, match="target_layer_ids"):
        load_weights_into(other, released)


def test_cli_exports_and_refuses_an_existing_directory(drafter, tmp_path):
    _checkpoint(tmp_path / "run", 1, drafter)
    out = tmp_path / "out"
    main([str(tmp_path / "run"), str(out), "--dtype", "fp32"])
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "run"), str(out)])
    assert exit_info.value.code == 2
    assert (out / "model.safetensors").read_bytes() == before  # nothing lost
    main([str(tmp_path / "run"), str(out), "--overwrite"])
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_cli_user_error_is_one_line_without_traceback(tmp_path):
    command = [sys.executable, "-m", "dflash_common.drafter.export", str(tmp_path / "missing"), str(tmp_path / "o")]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
