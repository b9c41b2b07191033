"""dflash-train killed with SIGKILL (no handler runs, nothing is flushed) at random steps and inside
a checkpoint save: the next run of the same command resumes from the newest complete checkpoint,
never a half-written one, and its losses from there on equal an uninterrupted run's bit for bit."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch
from fault_helpers import ROOT, subprocess_env, train_cmd
from train_helpers import train_args
from safetensors.torch import load_file

import train.loop as loop
from dflash_common.dirlock import LOCK_FILE
from train.checkpoint import (
    COMPLETE,
    PAUSE_IN_SAVE_ENV,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
)
from train.cli import parse
from train.metrics import METRICS_FILE, MetricsWriter, read_metrics

STEPS = 12
EXTRA = [
    f"--optim.max_steps={STEPS}",
    "--checkpoint.every_steps=4",
    "--checkpoint.keep_last=2",
    "--validation.every_steps=6",
    "--optim.grad_accum=2",
]
SEED = 20240607  # the kill points are random, but the same in every run of the test


class Trainer:
    """A dflash-train process whose stderr lines are collected on a thread while the test
    watches."""

    def __init__(self, args: list[str], **env: str):
        self.proc = subprocess.Popen(
            train_cmd(*args),
            cwd=ROOT,
            env=subprocess_env(**env),
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(
            target=lambda: self.lines.extend(self.proc.stderr), daemon=True
        )
        self._reader.start()

    def wait_until(self, ready, timeout: float = 60.0) -> bool:
        """Poll `ready()` until true (-> True) or the process ended first (-> False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return True
            if self.proc.poll() is not None:
                return ready()
            time.sleep(0.002)
        raise AssertionError("the trainer made no progress:\n" + self.text()[-3000:])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.finish()

    def finish(self) -> int:
        code = self.proc.wait(timeout=120)
        self._reader.join(timeout=10)
        return code

    def text(self) -> str:
        return "".join(self.lines)


def _curve(run_dir):
    keys = ("kind", "step", "epoch", "loss", "acc", "acc_by_pos", "tau", "lr", "grad_norm")
    return [tuple(json.dumps(r.get(k)) for k in keys) for r in read_metrics(run_dir)]


def _printed_step(trainer: Trainer, step: int) -> bool:
    return any(f" step {step}/{STEPS} " in line for line in trainer.lines)


def _check_after_kill(out: Path) -> int:
    """Every visible step-N is whole; -> the step the next run must resume from (0: none)."""
    for path in out.glob("step-*"):
        assert (path / COMPLETE).is_file() or not (path / "ranks.pt").exists(), (
            f"{path} looks taken but is half"
        )
    latest = latest_checkpoint(out)
    if latest is None:
        return 0
    trainer_state, ranks = load_checkpoint(latest)  # loadable, not merely present
    assert len(ranks) == 1 and trainer_state["step"] == int(latest.name.split("-")[1])
    return trainer_state["step"]


def test_sigkill_anywhere_then_resume_repeats_the_uninterrupted_losses(
    tiny_store, tiny_target, tmp_path
):
    rng = random.Random(SEED)
    straight = tmp_path / "straight"
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # as the subprocesses run (OMP_NUM_THREADS=1): the same float reductions
    try:
        loop.run(parse(train_args(tiny_store, tiny_target, straight, *EXTRA)))
    finally:
        torch.set_num_threads(threads)

    out, args = (
        tmp_path / "killed",
        train_args(tiny_store, tiny_target, tmp_path / "killed", *EXTRA),
    )
    resume_from, schedule = 0, []

    # 1. inside a checkpoint save: the drafter and optimiser state are written, the marker is not
    t = Trainer(args, **{PAUSE_IN_SAVE_ENV: "60"})

    def half():
        return [p for p in out.glob(".step-*.tmp-*") if (p / "trainer.pt").is_file()]

    assert t.wait_until(lambda: bool(half())), t.text()
    t.kill()
    saving = int(half()[0].name.split(".")[1].split("-")[1])
    assert not (out / f"step-{saving}").exists() and saving == 4
    resume_from = _check_after_kill(out)
    schedule.append(("in the save of step", saving, resume_from))
    assert resume_from == 0

    # 2.-3. at random points of random steps (during a step, a validation, a save, or between them)
    for _ in range(2):
        t = Trainer(args)
        step = rng.randint(resume_from + 1, STEPS - 1)
        if not t.wait_until(lambda: _printed_step(t, step)):
            break  # finished before the kill: nothing left to interrupt
        time.sleep(rng.uniform(0.0, 0.05))
        t.kill()
        text = t.text()
        if resume_from:
            assert f"resuming from {out / f'step-{resume_from}'} (step {resume_from})" in text, (
                text[-3000:]
            )
        else:
            assert "resuming" not in text
        if schedule[-1][0] == "in the save of step":
            assert "a save that never finished" in text and not list(out.glob(".step-*.tmp-*"))
        resume_from = _check_after_kill(out)
        schedule.append(("after step", step, resume_from))

    final = Trainer(args)
    assert final.finish() == 0, final.text()[-3000:]
    if resume_from:
        assert f"resuming from {out / f'step-{resume_from}'}" in final.text()
    assert len(schedule) >= 3, schedule  # the save and at least two random points were interrupted
    assert _curve(out) == _curve(straight), schedule
    assert [s for s, _ in complete_checkpoints(out)] == [8, 12]
    for rel in ("step-12/drafter/model.safetensors", "drafter/model.safetensors"):
        a, b = load_file(straight / rel), load_file(out / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel
    # no leftovers; the lock's file stays by design (its flock died with its holder: nothing is
    # stale)
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != LOCK_FILE]


def test_a_metrics_line_cut_by_a_kill_does_not_stop_the_resume(tmp_path):
    records = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / METRICS_FILE).write_text(text + '{"kind": "train", "step": 4, "lo')
    writer = MetricsWriter(tmp_path, 10, tensorboard=False, resume_step=2)
    writer.close()
    assert read_metrics(tmp_path) == records[:2]


def test_leftovers_of_a_killed_run_are_removed_and_never_resumed_from(
    tiny_store, tiny_target, tmp_path, monkeypatch
):
    """A half save, a half final drafter, and a step dir whose marker a pruning removed before the
    kill."""
    monkeypatch.setattr(loop, "save_report", lambda *a, **k: None)  # drawing: not under test, slow
    out = tmp_path / "run"
    args = train_args(
        tiny_store, tiny_target, out, "--optim.max_steps=4", "--checkpoint.every_steps=1"
    )
    real_step, calls = loop.train_step, []

    def step_then_sigterm(*a, **k):  # stopped after step 2 (a resume may not change the schedule)
        calls.append(real_step(*a, **k))
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return calls[-1]

    monkeypatch.setattr(loop, "train_step", step_then_sigterm)
    loop.run(parse(args))
    monkeypatch.setattr(loop, "train_step", real_step)
    assert [s for s, _ in complete_checkpoints(out)] == [1, 2]
    leftovers = [".step-6.tmp-123-abcd1234", ".drafter.tmp-123-abcd1234", "step-3"]
    for name in leftovers:
        (out / name).mkdir()
        (out / name / "trainer.pt").write_bytes(b"half")
    loop.run(parse(args))
    assert not (out / leftovers[0]).exists() and not (out / leftovers[1]).exists()
    assert load_checkpoint(out / "step-3")[0]["step"] == 3  # written anew, whole
    assert [r["step"] for r in read_metrics(out) if r["kind"] == "train"] == [1, 2, 3, 4]
