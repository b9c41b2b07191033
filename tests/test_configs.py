"""Every shipped config in configs/ loads into its stage's config tree.

A file's stage is the prefix of its name before the first '-' (`precompute-qwen3-8b.toml` ->
precompute); a new stage adds its config class to STAGES."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from dflash_common.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
STAGES = {
    "precompute": "dflash_common.precompute_config:PrecomputeConfig",
    "train": "dflash_common.train_config:TrainConfig",
    "eval": "dflash_common.eval_config:EvalConfig",
}


def stage_class(path: Path) -> type:
    stage = path.stem.split("-", 1)[0]
    assert stage in STAGES, f"{path.name}: no config class known for stage '{stage}'; add it to STAGES"
    module, name = STAGES[stage].split(":")
    return getattr(importlib.import_module(module), name)


SHIPPED = sorted(CONFIGS.glob("*.toml"))


def test_configs_are_shipped():
    assert {p.stem.split("-", 1)[0] for p in SHIPPED} >= {"precompute"}


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_loads(path):
    cls = stage_class(path)
    cfg = load_config(cls, path)  # unknown keys, wrong types and failed checks raise ConfigError
    assert cfg != cls(), f"{path.name} sets nothing"
