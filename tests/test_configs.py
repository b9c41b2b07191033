"""Every shipped config in configs/ loads into its stage's config tree.

A file's stage is the prefix of its name before the first '-' (`precompute-qwen3-8b.toml` ->
precompute); a new stage adds its config class to STAGES."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from dflash_common.config import STAGES as FILE_STAGES
from dflash_common.config import load_config, read_toml

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
STAGES = {
    "generate": "precompute.generate.config:GenerateConfig",
    "precompute": "precompute.config:PrecomputeConfig",
    "train": "train.config:TrainConfig",
    "eval": "train.eval.config:EvalConfig",
}


def stage_classes(path: Path) -> list[type]:
    """The config classes a file is for: its name's stage, or each stage table of a several-stage
    file."""
    data = read_toml(path)
    stages = sorted(data) if data and set(data) <= set(STAGES) else [path.stem.split("-", 1)[0]]
    for stage in stages:
        assert stage in STAGES, (
            f"{path.name}: no config class known for stage '{stage}'; add it to STAGES"
        )
    return [
        getattr(importlib.import_module(STAGES[s].split(":")[0]), STAGES[s].split(":")[1])
        for s in stages
    ]


SHIPPED = sorted(CONFIGS.glob("*.toml"))


def test_configs_are_shipped():
    assert {p.stem.split("-", 1)[0] for p in SHIPPED} >= {"precompute", "train", "eval", "tiny"}
    assert set(FILE_STAGES) == set(STAGES)


def test_the_embedded_default_holds_every_stage():
    assert [cls.STAGE for cls in stage_classes(CONFIGS / "tiny.toml")] == [
        "eval",
        "generate",
        "precompute",
        "train",
    ]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_loads(path):
    for cls in stage_classes(path):
        # unknown keys, wrong types and failed checks raise ConfigError
        cfg = load_config(cls, path)
        assert cfg != cls(), f"{path.name} sets nothing for {cls.STAGE}"


def test_a_file_of_stage_tables_without_this_stage_is_one_sentence(tmp_path):
    from dflash_common.config import ConfigError
    from train.config import TrainConfig

    path = tmp_path / "exp.toml"
    path.write_text("[precompute.store]\npath = 's'\n")
    with pytest.raises(
        ConfigError, match=r"holds the stages \['precompute'\] but no \[train\] table"
    ):
        load_config(TrainConfig, path)
