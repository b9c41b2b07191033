"""What a resumed run may change: a rerun into a run directory with checkpoints goes on from the
newest, and its settings are held against the ones that wrote it (`step-N/run.toml`).

Settings that define what is trained (the drafter, the optimiser and its schedule, the objective,
the data and the seed) must be the checkpoint's: the optimiser state, the schedule and the data
position go on from it, so a new value would be recorded but not trained (a new peak lr, say, while
the scheduler keeps the old one). Such a rerun is refused, naming each setting. Settings of how the
run is carried out (logging, progress, checkpoint and validation cadence, cache size, reader
threads, device, precision) take their new values, and the run's record (run.json) lists them.
`checkpoint.resume = false` starts the run over in its directory: the earlier run's checkpoints and
final drafter are removed once the new run has passed every check.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tomllib
from pathlib import Path
from typing import Any

from dflash_common.config import iter_fields, to_dict
from dflash_common.drafter.config import DrafterConfig
from dflash_common.drafter.record import read_drafter_config
from dflash_common.errors import UserError
from train.checkpoint import COMPLETE, complete_checkpoints, latest_checkpoint
from train.config import BEFORE_THEY_EXISTED, TrainConfig

log = logging.getLogger("dflash")

# Settings (dotted, or a section ending in '.') whose new value a resume applies: none changes the
# weights, optimiser state or data order an uninterrupted run would reach. Every other setting is
# the checkpoint's or refused. A setting added since a checkpoint was written is absent from its
# run.toml: that run trained with the behaviour the new field's default keeps, so it matches the
# default and nothing else, unless BEFORE_THEY_EXISTED says what that run did instead.
APPLIED_ON_RESUME = (
    "log.",
    "checkpoint.",
    "validation.",
    "precision.",
    "data.cache_gb",
    "data.reader_threads",
    "data.host_prefetch",
    "data.gpu_prefetch",
    "data.on_bad_shard",
    "run.out_dir",
    "run.target",
    "run.device",
)
# The drafter's shape, compared as the resolved drafter (drafter.layer_ids unset, and set to the
# store's layers, is one drafter); a checkpoint of another drafter is refused by that comparison.
_RESOLVED = (
    "drafter.depth",
    "drafter.block_size",
    "drafter.layer_ids",
    "drafter.mask_token_id",
    "drafter.layer_types",
    "drafter.sliding_window",
)
_PATHS = ("data.stores", "drafter.init_from")  # compared as the places they name
_DEFAULTS = {key: default for key, _, default, _ in iter_fields(TrainConfig)}


def applied_on_resume(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in APPLIED_ON_RESUME)


def new_run_hint(out: Path) -> str:
    return (
        f"start a new run: in another run directory (--out), or over again in {out} with "
        f"--checkpoint.resume=false, which removes its checkpoints"
    )


def checkpoint_to_resume(
    cfg: TrainConfig, out: Path, dcfg: DrafterConfig
) -> tuple[Path | None, dict[str, Any]]:
    """(the newest complete checkpoint to resume from or None, the settings that take new values:
    key -> [old, new]); one sentence when it holds another drafter or was trained with other
    settings of what is trained (before anything of this run is written)."""
    path = latest_checkpoint(out) if cfg.checkpoint.resume else None
    if path is None:
        return None, {}
    saved = read_drafter_config(
        path / "drafter", fix=f"delete {path} to resume from an older checkpoint"
    )
    differ = [
        # (a config of another arch has other fields: None there)
        f.name
        for f in dataclasses.fields(dcfg)
        if getattr(saved, f.name, None) != getattr(dcfg, f.name)
    ]
    if differ:
        detail = ", ".join(
            f"{f} = {getattr(saved, f, None)!r} there vs {getattr(dcfg, f)!r} here"
            for f in differ[:3]
        )
        raise UserError(
            f"cannot resume from {path}: it holds another drafter ({detail}); resume with the "
            f"settings of {path / 'run.toml'}, or start a new run directory (--out)."
        )
    return path, changed_settings(path, cfg, out)


def changed_settings(path: Path, cfg: TrainConfig, out: Path) -> dict[str, Any]:
    """The settings that differ from checkpoint `path`'s run.toml: refused if any defines what is
    trained, else returned (key -> [old, new]) to be applied and recorded."""
    try:
        before = _flat(tomllib.loads((path / "run.toml").read_text()))
    except (OSError, ValueError) as e:
        raise UserError(
            f"checkpoint {path} has no readable run.toml ({e}), so its settings are "
            f"unknown; delete {path} to resume from an older checkpoint, or "
            f"{new_run_hint(out)}."
        ) from e
    now = _flat(to_dict(cfg))
    keys = [
        k for k in sorted(set(before) | set(now)) if k not in _RESOLVED and _differs(k, before, now)
    ]
    refused = [k for k in keys if not applied_on_resume(k)]
    if refused:
        # settings the checkpoint predates: its run.toml lacks them, the command line must name them
        older = {k: v for k, v in BEFORE_THEY_EXISTED.items() if k in refused and k not in before}
        before = {**older, **before}
        detail = ", ".join(
            f"{k} = {_setting_value(before.get(k))} there vs {_setting_value(now.get(k))} here"
            for k in refused
        )
        also = "".join(f" and --{k}={v}" for k, v in older.items())
        raise UserError(
            f"cannot resume from {path} with other settings of what it trains ({detail}): the "
            f"optimiser, its schedule and the data order go on from the checkpoint; rerun with "
            f"the settings of {path / 'run.toml'}{also} to resume it, or {new_run_hint(out)}."
        )
    return {k: [before.get(k), now.get(k)] for k in keys if k != "run.out_dir"}


def _differs(key: str, before: dict[str, Any], now: dict[str, Any]) -> bool:
    if key not in before and key in now:  # a setting added since: the checkpoint ran its default
        return now[key] != BEFORE_THEY_EXISTED.get(key, _DEFAULTS.get(key, now[key]))
    a, b = before.get(key), now.get(key)
    if key in _PATHS:  # the same places however spelt (relative, through another working directory)
        a, b = _places(a), _places(b)
    return a != b


def _places(value: Any) -> Any:
    if value is None:
        return None
    return (
        [os.path.realpath(v) for v in value] if isinstance(value, list) else os.path.realpath(value)
    )


def _setting_value(value: Any) -> str:
    return "unset" if value is None else repr(value)


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        out.update(
            _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value}
        )
    return out


def discard_earlier_run(out: Path) -> None:
    """checkpoint.resume = false: remove the checkpoints and final drafter an earlier run left in
    `out`, which would otherwise stand in for this run's saves of the same steps, outlive them when
    old ones are pruned, and be resumed from by a later rerun."""
    found = [p for _, p in complete_checkpoints(out)] + [p for p in [out / "drafter"] if p.exists()]
    if not found:
        return
    log.warning(
        "checkpoint.resume = false: starting over in %s, removing the earlier run's %s",
        out,
        ", ".join(p.name for p in found),
    )
    for path in found:
        # the marker first: a crash mid-delete leaves nothing that looks complete
        (path / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(path)


def resume_record(out: Path, path: Path | None, changed: dict[str, Any]) -> dict[str, Any]:
    """run.json's `resumes`: every resume of this run so far (kept from the run.json it replaces),
    each with the checkpoint it went on from and the settings that took new values there."""
    if path is None:
        return {"resumes": []}
    try:
        earlier = list(json.loads((out / "run.json").read_text())["resumes"])
    except (OSError, ValueError, KeyError, TypeError):
        earlier = []
    return {"resumes": [*earlier, {"from": path.name, "changed": changed}]}
