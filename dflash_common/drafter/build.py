"""The drafter module a config describes (build.py imports every kind; model.py, which the others
build on, imports none of them)."""

from __future__ import annotations

from dflash_common.drafter.config import DrafterConfig
from dflash_common.drafter.dflash2 import DFlash2Drafter
from dflash_common.drafter.model import DFlashDrafter


def new_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """DFlash's drafter, or DFlash2's when `cfg.dflash2` is set."""
    return DFlash2Drafter(cfg) if cfg.dflash2 is not None else DFlashDrafter(cfg)
