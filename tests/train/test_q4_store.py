"""Training from q4_hadamard stores: the losses of a run stay close to those of the same run from
bf16 states of the same data (same shards, same batches, same anchors), also with bf16 and
q4_hadamard stores mixed in one run, and a stopped run resumes bit for bit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import train.loop as loop
from train.cli import main, parse
from train.metrics import read_metrics

from train_helpers import write_tiny_store, train_args

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
# The drafter sees 4-bit states (relative L2 error ~0.07 against bf16's ~0.002): its losses move
# by ~0.1% (measured: at most 0.09% alone, 0.12% mixed over 6 steps), while training moves them by
# ~25% over these runs.
CLOSE = 0.005


def _args(stores, target, out, *extra):
    return train_args(
        stores,
        target,
        out,
        f"--optim.max_steps={STEPS}",
        "--data.gpu_prefetch=0",
        "--validation.every_steps=0",
        *extra,
    )


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    rel = [abs(a - b) / b for a, b in zip(got, want)]
    assert max(rel) < CLOSE, (got, want)
    assert got != want  # the states did differ: 4 bits are not bf16
    assert (
        abs(want[0] - want[-1]) / want[0] > 3 * CLOSE
    )  # training moved the loss more than the codec did


def test_a_q4_store_trains_as_the_bf16_store_of_the_same_data(
    tiny_store, tiny_store_q4, tiny_target, tmp_path
):
    main(_args([tiny_store], tiny_target, tmp_path / "bf16"))
    main(_args([tiny_store_q4], tiny_target, tmp_path / "q4"))
    _close(_losses(tmp_path / "q4"), _losses(tmp_path / "bf16"))


@pytest.fixture(scope="module")
def halves(tiny_target, tmp_path_factory):
    """Records 0-23 in bf16, and records 24-47 in bf16 and in q4_hadamard (same shard names)."""
    root = tmp_path_factory.mktemp("halves")
    first = write_tiny_store(root / "first", tiny_target, n_shards=3)
    second = {
        d: write_tiny_store(root / f"second-{d}", tiny_target, n_shards=3, first_record=24, dtype=d)
        for d in ("bf16", "q4_hadamard")
    }
    return first, second


def test_mixed_bf16_and_q4_stores_train_as_two_bf16_stores(halves, tiny_target, tmp_path):
    first, second = halves
    main(_args([first, second["bf16"]], tiny_target, tmp_path / "bf16"))
    main(_args([first, second["q4_hadamard"]], tiny_target, tmp_path / "mixed"))
    _close(_losses(tmp_path / "mixed"), _losses(tmp_path / "bf16"))


def test_a_run_from_mixed_stores_resumes_bit_for_bit(halves, tiny_target, tmp_path, monkeypatch):
    first, second = halves
    stores = [first, second["q4_hadamard"]]
    extra = ["--checkpoint.every_steps=100"]
    loop.run(parse(_args(stores, tiny_target, tmp_path / "straight", *extra)))

    real_step, calls = loop.train_step, []

    def step_then_sigterm(*a, **k):
        info = real_step(*a, **k)
        calls.append(info.epoch)
        if len(calls) == 3:
            os.kill(
                os.getpid(), signal.SIGTERM
            )  # the real handler: save at this step boundary, leave
        return info

    monkeypatch.setattr(loop, "train_step", step_then_sigterm)
    stopped = tmp_path / "stopped"
    loop.run(parse(_args(stores, tiny_target, stopped, *extra)))
    assert len(_losses(stopped)) == 3
    monkeypatch.setattr(loop, "train_step", real_step)
    loop.run(parse(_args(stores, tiny_target, stopped, *extra)))  # the same command again: resumes
    assert _losses(stopped) == _losses(tmp_path / "straight")
