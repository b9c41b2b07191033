"""Rewrite docs/config.md from the stages' config classes (`--check`: exit 1 if it is out of
date)."""

from __future__ import annotations

from dflash_common.config_doc import Stage, main
from precompute.config import PrecomputeConfig
from precompute.generate.config import GenerateConfig
from train.config import TrainConfig
from train.eval.config import EvalConfig

# in the order of the data path
STAGES: list[Stage] = [
    ("generate", "dflash-generate", GenerateConfig),
    ("precompute", "dflash-precompute", PrecomputeConfig),
    ("train", "dflash-train", TrainConfig),
    ("eval", "dflash-eval", EvalConfig),
]

if __name__ == "__main__":
    main(STAGES)
