"""The step-N/ protocol: whole or absent, newest complete wins, keep the last K, signals set a flag.
(Exact resume of a whole run: tests/train/test_loop.py.)"""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
import torch

from train.checkpoint import (
    COMPLETE,
    StopRequest,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    remove_stale_saves,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from train.config import TrainConfig


def _save(run_dir, step, keep_last=3, fail=False):
    def save_drafter(d):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"w%d" % step)
        if fail:
            raise OSError("disk full")

    return save_checkpoint(
        run_dir,
        step,
        save_drafter=save_drafter,
        trainer_state={"step": step},
        rank_states=[{"data": {"i": step}}],
        cfg=TrainConfig(),
        keep_last=keep_last,
    )


def test_a_checkpoint_is_published_whole_with_its_marker(tmp_path):
    path = _save(tmp_path, 7)
    assert path.name == "step-7" and (path / COMPLETE).is_file()
    assert {p.name for p in path.iterdir()} >= {
        "drafter",
        "trainer.pt",
        "ranks.pt",
        "run.toml",
        COMPLETE,
    }
    trainer, ranks = load_checkpoint(path)
    assert trainer == {"step": 7} and ranks == [{"data": {"i": 7}}]
    assert [p.name for p in tmp_path.iterdir()] == ["step-7"]  # nothing left aside


def test_a_failed_save_leaves_nothing_visible(tmp_path):
    _save(tmp_path, 1)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2, fail=True)
    assert [p.name for p in tmp_path.iterdir()] == ["step-1"] and latest_checkpoint(
        tmp_path
    ).name == "step-1"


def test_newest_complete_wins_and_incomplete_or_stale_ones_are_ignored(tmp_path):
    for step in (5, 10, 20):
        _save(tmp_path, step)
    (tmp_path / "step-20" / COMPLETE).unlink()  # as if the marker never made it
    (tmp_path / ".step-30.tmp-1-abc").mkdir()
    assert latest_checkpoint(tmp_path).name == "step-10"
    remove_stale_saves(tmp_path)
    assert not (tmp_path / ".step-30.tmp-1-abc").exists()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step-20")


def test_keeps_the_last_k(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [3, 4]


def test_rng_states_round_trip_through_a_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_sigterm_sets_a_flag_and_the_old_handler_returns():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
