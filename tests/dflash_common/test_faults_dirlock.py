"""One training per run directory, one precompute job per store: a second job is refused in one
sentence naming the holder's pid; the lock dies with its holder (a SIGKILL leaves nothing stale)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_common.errors import UserError
from dflash_common.config import load_config
from dflash_common.dirlock import LOCK_FILE, hold_directory

ROOT = Path(__file__).resolve().parents[2]
_HOLD = ("import sys, time; from dflash_common.dirlock import hold_directory\n"
         "with hold_directory(sys.argv[1], 'x', 'y'):\n    print('held', flush=True); time.sleep(600)\n")


def _holder(directory: Path) -> subprocess.Popen:
    """Another process holding `directory`'s lock (as another dflash-train or precompute job would)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(directory)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_second_training_into_a_held_run_directory_is_refused_naming_the_pid(tmp_path):
    from train.config import TrainConfig
    from train.loop import run

    out = tmp_path / "run"
    holder = _holder(out)
    try:
        cfg = load_config(TrainConfig, None, [f"--run.out_dir={out}"])
        with pytest.raises(UserError, match=rf"run directory {out} is in use by another job \(pid {holder.pid} "):
            run(cfg)
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # it read and wrote nothing
    finally:
        _kill(holder)


def test_a_second_precompute_into_a_held_store_is_refused_naming_the_pid(tmp_path):
    from precompute.config import PrecomputeConfig
    from precompute.job import run

    store = tmp_path / "store"
    holder = _holder(store)
    try:
        cfg = load_config(PrecomputeConfig, None, [f"--store.path={store}", "--run.device=cpu"])
        with pytest.raises(UserError, match=rf"store {store} is in use by another job \(pid {holder.pid} "):
            run(cfg)
        assert sorted(p.name for p in store.iterdir()) == [LOCK_FILE]
    finally:
        _kill(holder)


def test_the_lock_dies_with_its_killed_holder_and_is_exclusive_within_a_process(tmp_path):
    holder = _holder(tmp_path)
    _kill(holder)  # SIGKILL: no cleanup ran, the lock file stays, the lock does not
    started = time.monotonic()
    with hold_directory(tmp_path, "run directory", "fix"):
        assert f"pid {os.getpid()} " in (tmp_path / LOCK_FILE).read_text()
        with pytest.raises(UserError, match=f"pid {os.getpid()} "):  # a second open file: flock conflicts
            with hold_directory(tmp_path, "run directory", "fix"):
                pass
    with hold_directory(tmp_path, "run directory", "fix"):  # released on exit
        pass
    assert time.monotonic() - started < 5


def test_a_lock_file_tidied_away_between_open_and_lock_is_not_held(tmp_path, monkeypatch):
    """A refused job removes the lock file it made, under its lock; a job that opened the file just
    before takes the lock on the removed file: it must see that and lock the file now named."""
    import fcntl

    import dflash_common.dirlock as dirlock

    real, calls = fcntl.flock, []

    def flock_after_a_tidy(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            (tmp_path / "run" / LOCK_FILE).unlink()  # another job's tidy, between open and lock
        return real(fd, op)

    monkeypatch.setattr(dirlock.fcntl, "flock", flock_after_a_tidy)
    with hold_directory(tmp_path / "run", "run directory", "fix") as path:
        assert len(calls) == 2 and path.is_file()  # the second try locked the file that is named
        assert path.read_text().startswith(f"pid {os.getpid()} ")
    with hold_directory(tmp_path / "new", "run directory", "fix", tidy=True):
        pass
    assert not (tmp_path / "new").exists()  # nothing written into it: tidied away
