"""Ctrl-C (SIGINT) while dflash-precompute writes shards: one sentence saying what was kept and how
to resume, exit 130, no traceback; rerunning the command ends with the uninterrupted store."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from dflash_common.store import Store
from precompute import job

from precompute_helpers import (
    ROOT,
    cli_args,
    demo_inputs,
    interrupt_says_what_is_kept,
    job_overrides,
    make_config,
    store_files,
    subprocess_env,
)


def _wait_for_a_shard(store, proc) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        shards = store / "shards"
        if shards.is_dir() and any(p.is_dir() for p in shards.iterdir()):
            return
        if proc.poll() is not None:
            pytest.fail(f"the job ended before writing a shard: {proc.stderr.read()[-2000:]}")
        time.sleep(0.002)
    proc.kill()
    pytest.fail("no shard appeared within 120 s")


def test_ctrl_c_mid_job_is_one_sentence_exit_130_and_the_rerun_finishes_the_same_store(
    tiny_target, tmp_path
):
    inputs = demo_inputs(tmp_path)
    straight = tmp_path / "straight"
    job.run(make_config(tiny_target, inputs, straight, *job_overrides("bf16")))
    store = tmp_path / "interrupted"
    cmd = [
        sys.executable,
        "-m",
        "precompute.cli",
        *cli_args(tiny_target, inputs, store, "bf16"),
        "--run.writer_threads=1",
        "--run.queue_depth=1",
    ]
    # SIGINT at its default in the child: a test run started in the background of a non-interactive
    # shell (`make test &`) ignores SIGINT, the child would inherit that, and Python then installs
    # no handler
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    _wait_for_a_shard(store, proc)
    interrupt_says_what_is_kept(proc, store)
    published = len([p for p in (store / "shards").iterdir() if p.is_dir()])
    assert published < 12, "the job had finished before the interrupt"
    job.run(make_config(tiny_target, inputs, store, *job_overrides("bf16")))
    assert store_files(store) == store_files(straight)
    assert Store.open(store).summary["runs"][-1]["units_written"] == 12 - published
    assert not any((store / ".staging").iterdir())


def test_ctrl_c_in_training_start_up_is_one_sentence_and_exit_130(monkeypatch, tmp_path, capsys):
    import train.loop
    from train.cli import main

    def interrupted(cfg, ranks):
        raise KeyboardInterrupt

    monkeypatch.setattr(
        train.loop, "setup", interrupted
    )  # Ctrl-C while the stores open, the target loads...
    with pytest.raises(SystemExit) as exit_info:
        main([f"--run.out_dir={tmp_path / 'run'}", "--store", str(tmp_path / "store")])
    assert exit_info.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1] == (
        f"interrupted: the checkpoints already saved in {tmp_path / 'run'} are kept (a "
        f"save being written is not visible); rerun the same command to resume from "
        f"the newest."
    )
