"""Which drafter a config names: DFlash (config.py, model.py) or a drafter built on its backbone
with parts of its own (DSpark: dspark.py, heads on the block; DFlash2: dflash2.py, convolutions in
the layers and a candidate selector). `arch` is the trainer's `drafter.arch` and
`DrafterConfig.arch`; a released config.json names it by its `architectures` entry. Each arch's
config class says how its config.json is written and read (`to_config_json`,
`_own_fields_from_config_json`), its drafter class how it drafts (`greedy_drafts`); what differs
in the lint (serving.py), the objective (train/objective.py) and eval (train/eval) goes by
`cfg.arch`.

    cfg = config_class("dspark").from_target(target_config, mask_token_id=..., markov_rank=64)
    cfg = config_from_json(json.loads(Path("drafter/config.json").read_text()))
    drafter = new_drafter(cfg)          # DFlashDrafter, DSparkDrafter or DFlash2Drafter
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, get_args

from dflash_common.config import ConfigError
from dflash_common.drafter.config import Arch, DrafterConfig
from dflash_common.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash_common.drafter.dspark import DSparkConfig, DSparkDrafter
from dflash_common.drafter.model import DFlashDrafter

# arch -> (its config class, its model class)
ARCHS: dict[Arch, tuple[type[DrafterConfig], type[DFlashDrafter]]] = {
    "dflash": (DrafterConfig, DFlashDrafter),
    "dspark": (DSparkConfig, DSparkDrafter),
    "dflash2": (DFlash2Config, DFlash2Drafter),
}
assert tuple(ARCHS) == get_args(Arch), "drafter/config.py's Arch and ARCHS name the same archs"


def config_class(arch: str) -> type[DrafterConfig]:
    if arch not in ARCHS:
        raise ConfigError(f"drafter arch {arch!r} unknown; use one of {', '.join(ARCHS)}.")
    return ARCHS[arch][0]


def class_of_json(data: Mapping[str, Any]) -> type[DrafterConfig]:
    """The config class a released config.json's `architectures` names (DFlash's when it names none
    we know), without reading the rest of it."""
    names = data.get("architectures") or []
    for config_cls, _ in ARCHS.values():
        if config_cls.ARCHITECTURE in names:
            return config_cls
    return DrafterConfig


def config_from_json(data: Mapping[str, Any]) -> DrafterConfig:
    """The config of a released config.json, of the class its `architectures` names (DFlash's when
    it names none we know: that reader then says what it expected)."""
    return class_of_json(data).from_config_json(data)


def new_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """The drafter `cfg` describes, randomly initialised (on the current default device)."""
    return ARCHS[cfg.arch][1](cfg)


def as_arch(cfg: DrafterConfig, arch: str, **own: Any) -> DrafterConfig:
    """`cfg`'s backbone (every DFlash field) under `arch`, with that arch's own fields `own` (their
    defaults otherwise)."""
    backbone = {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(DrafterConfig) if f.name != "arch"
    }
    return config_class(arch)(**backbone, **own)
