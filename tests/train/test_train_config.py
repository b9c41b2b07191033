"""The train config tree: shipped configs load, recipe defaults hold, bad values name their key."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_common.config import ConfigError, iter_fields, load_config
from train.config import TrainConfig

_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIGS = sorted([*_DIR.glob("train-*.toml"), _DIR / "tiny.toml"])


# tests/test_configs.py loads every config
def test_the_two_shipped_configs_name_stores_and_a_target():
    assert {p.name for p in CONFIGS} >= {"tiny.toml", "train-qwen3-8b.toml"}
    for path in CONFIGS:
        cfg = load_config(TrainConfig, path)
        assert cfg.data.stores and cfg.run.target


def test_defaults_are_the_dflash_recipe():
    cfg = TrainConfig()
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip) == (6e-4, 0.0, 1.0)
    assert (cfg.optim.warmup_fraction, cfg.optim.schedule, cfg.optim.epochs) == (0.04, "cosine", 6)
    assert (cfg.drafter.block_size, cfg.drafter.depth, cfg.objective.max_anchors) == (16, 5, 512)
    assert cfg.data.batch_tokens == 65536
    assert all(help for _, _, _, help in iter_fields(TrainConfig))


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("--data.gpu_prefetch=2", "data.gpu_prefetch"),
        ("--data.weights=[1.0]", "data.weights"),
        ("--optim.warmup_fraction=1.5", "optim.warmup_fraction"),
        ("--optim.betas=[0.9]", "optim.betas"),
        ('--drafter.layer_types=["full_attention"]', "drafter.layer_types"),
        (
            '--drafter.layer_types=["sliding_attention","full_attention","full_attention",'
            '"full_attention","full_attention"]',
            "drafter.sliding_window",
        ),
        ("--run.device=tpu", "run.device"),
        ("--precision.autocast=fp16", "precision.autocast"),
        ("--objective.path_weight=-1", "objective.path_weight"),
        ("--objective.path_weight=nan", "objective.path_weight"),
    ],
)
def test_bad_values_are_one_sentence_naming_the_key(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, None, [override])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_dpace_the_default_weights_combines_with_soft_targets_and_prompt_anchors():
    """D-PACE takes its confidence from the soft loss's per-row CE as from the hard loss's."""
    for argv in (["--targets.soft=kl"], ["--targets.soft=tv", "--targets.prompt_anchors=true"]):
        cfg = load_config(TrainConfig, None, argv)
        assert cfg.objective.weights == "dpace" and cfg.targets.needs_final_state
    assert (
        load_config(
            TrainConfig, None, ["--objective.weights=gamma", "--targets.soft=kl"]
        ).objective.weights
        == "gamma"
    )


def test_path_weight_is_off_by_default_and_refused_with_soft_targets_in_one_sentence():
    assert TrainConfig().objective.path_weight == 0.0
    for argv in (["--targets.soft=kl"], ["--targets.prompt_anchors=true"]):
        with pytest.raises(ConfigError) as e:
            load_config(
                TrainConfig, None, ["--objective.weights=gamma", "--objective.path_weight=1", *argv]
            )
        assert "objective.path_weight" in str(e.value) and "\n" not in str(e.value)
    assert (
        load_config(TrainConfig, None, ["--objective.path_weight=1"]).objective.path_weight == 1.0
    )
