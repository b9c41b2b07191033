"""Which drafter a config names: DFlash (config.py, model.py) or a drafter built on its backbone
with heads of its own (DSpark: dspark.py). `arch` is the trainer's `drafter.arch` and
`DrafterConfig.arch`; a released config.json names it by its `architectures` entry.

    cfg = config_class("dspark").from_target(target_config, mask_token_id=..., markov_rank=64)
    cfg = config_from_json(json.loads(Path("drafter/config.json").read_text()))
    drafter = new_drafter(cfg)          # DFlashDrafter or DSparkDrafter
"""

from __future__ import annotations

from typing import Any, Mapping

from dflash_common.config import ConfigError
from dflash_common.drafter.config import DrafterConfig
from dflash_common.drafter.dspark import DSparkConfig, DSparkDrafter
from dflash_common.drafter.model import DFlashDrafter

# arch -> (its config class, its model class)
ARCHS: dict[str, tuple[type[DrafterConfig], type[DFlashDrafter]]] = {
    "dflash": (DrafterConfig, DFlashDrafter),
    "dspark": (DSparkConfig, DSparkDrafter),
}


def config_class(arch: str) -> type[DrafterConfig]:
    if arch not in ARCHS:
        raise ConfigError(f"drafter arch {arch!r} unknown; use one of {', '.join(ARCHS)}.")
    return ARCHS[arch][0]


def config_from_json(data: Mapping[str, Any]) -> DrafterConfig:
    """The config of a released config.json, of the class its `architectures` names (DFlash's when
    it names none we know: that reader then says what it expected)."""
    names = data.get("architectures") or []
    for config_cls, _ in ARCHS.values():
        if config_cls.ARCHITECTURE in names:
            return config_cls.from_config_json(data)
    return DrafterConfig.from_config_json(data)


def new_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """The drafter `cfg` describes, randomly initialised (on the current default device)."""
    return ARCHS[cfg.arch][1](cfg)
