"""Checkpoints of a training run: `step-N/` directories that resume a run exactly.

    step-N/
      drafter/config.json, drafter/model.safetensors   the drafter in the released layout (fp32 master)
      trainer.pt        optimiser and lr-scheduler state, the step
      ranks.pt          per rank: data-pipeline position and RNG states (torch, cuda, python, numpy)
      run.toml/json     the resolved config (and versions, git revision) of the run that wrote it
      COMPLETE          written last

The directory is written aside under a hidden name, the marker written last, everything fsynced and
then published with one rename, so a `step-N/` either is whole or does not exist. Resume takes the
newest directory that has its marker and ignores anything else. The anchor generator needs no state:
anchors are drawn from a generator seeded by (seed, epoch, batch) (train/data.py), so the data
position alone reproduces them.

SIGTERM and SIGINT only set a flag (`StopRequest`); the loop saves at the next step boundary and exits
with code 0.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dflash_common.cli import write_run_record
from dflash_common.fsutil import atomic_write_text, fsync_tree, publish_dir, temp_sibling
from train.config import TrainConfig

log = logging.getLogger("dflash")

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Fault tests set this (seconds) to hold every save half-written, the drafter and optimiser state on
# disk and the rank states and marker not yet, so a SIGKILL lands inside the save every time.
PAUSE_IN_SAVE_ENV = "DFLASH_TEST_PAUSE_IN_CHECKPOINT_S"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"step-{step}"


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `run_dir`, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for path in run_dir.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            if (path / COMPLETE).is_file():
                found.append((int(match.group(1)), path))
            else:
                log.warning("ignoring %s: it has no %s marker (an interrupted save)", path, COMPLETE)
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def rng_state() -> dict[str, Any]:
    """Every RNG the process could draw from, in a form `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    save_drafter: Callable[[Path], None],
    trainer_state: dict[str, Any],
    rank_states: list[dict[str, Any]],
    cfg: TrainConfig,
    keep_last: int,
) -> Path:
    """Write `step-N/` aside, mark it complete, publish it by rename, drop all but the last `keep_last`.

    `save_drafter(dir)` writes the released layout into `dir`; `trainer_state` holds the optimiser and
    scheduler state dicts and counters; `rank_states[r]` the data position and RNG states of rank r.
    """
    final = step_dir(run_dir, step)
    if (final / COMPLETE).is_file():  # a resumed run reaching a step it already saved: that save stands
        return final
    shutil.rmtree(final, ignore_errors=True)  # a step dir without its marker is never a checkpoint
    tmp = temp_sibling(final)
    tmp.mkdir(parents=True)
    try:
        save_drafter(tmp / "drafter")
        _torch_save(trainer_state, tmp / "trainer.pt")
        if os.environ.get(PAUSE_IN_SAVE_ENV):
            time.sleep(float(os.environ[PAUSE_IN_SAVE_ENV]))
        _torch_save(rank_states, tmp / "ranks.pt")
        write_run_record(tmp, cfg, name="run")  # not config.json: that name means "a drafter directory"
        atomic_write_text(tmp / COMPLETE, f"step {step}\n", durable=False)
        fsync_tree(tmp)
        publish_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune_checkpoints(run_dir, keep_last)
    return final


def _torch_save(obj: Any, path: Path) -> None:
    """torch.save through a Python file: a full disk then raises OSError(ENOSPC), where torch's own
    file writer raises a RuntimeError that does not say why ('unexpected pos 576 vs 534')."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (incomplete ones are left alone)."""
    for _, path in complete_checkpoints(run_dir)[:-keep_last]:
        (path / COMPLETE).unlink()  # first, so a crash mid-delete leaves nothing that looks complete
        shutil.rmtree(path)


def remove_stale_saves(run_dir: str | Path) -> None:
    """Delete what a killed process left behind: hidden half-written `step-N` and `drafter`
    directories, and `step-N` directories whose marker a pruning had already removed. Call it before
    this run writes anything (one run owns its directory)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    for path in [*run_dir.glob(".step-*.tmp-*"), *run_dir.glob(".drafter.tmp-*")]:
        log.info("removing %s, a save that never finished", path)
        shutil.rmtree(path, ignore_errors=True)
    for path in run_dir.glob("step-*"):
        if _STEP_DIR.match(path.name) and path.is_dir() and not (path / COMPLETE).is_file():
            log.info("removing %s, a checkpoint without its %s marker (its deletion was cut short)", path, COMPLETE)
            shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(trainer_state, rank_states) of a complete checkpoint; the drafter is read by the caller from
    `path/drafter`."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    rank_states = torch.load(path / "ranks.pt", map_location="cpu", weights_only=True)
    return trainer_state, rank_states


class StopRequest:
    """SIGTERM/SIGINT set a flag instead of killing the process mid-step; a second SIGINT stops at once.

    Use as a context manager around the loop; the previous handlers come back on exit.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s received: saving a checkpoint at the end of this step, then exiting "
                    "(press Ctrl-C again to stop at once without saving)", signal.Signals(signum).name)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
