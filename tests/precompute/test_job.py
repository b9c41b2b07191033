"""dflash-precompute as users run it: real processes under torchrun (gloo, CPU) on the tiny target.

The store must be the same bits whatever the number of ranks, a rerun must write nothing, and a job
SIGKILLed mid-way must, once rerun, leave the store an uninterrupted job leaves."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_common.errors import UserError
from dflash_common.store import Store
from precompute import job

from precompute_helpers import (
    ROOT,
    cli_args,
    demo_inputs,
    job_overrides,
    make_config,
    store_files,
    subprocess_env,
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return demo_inputs(tmp_path_factory.mktemp("inputs"))


def _shard_stamps(path: Path) -> dict[str, tuple[int, int]]:
    return {
        str(f.relative_to(path)): (f.stat().st_ino, f.stat().st_mtime_ns)
        for f in (path / "shards").rglob("*")
    }


@pytest.fixture(scope="module")
def one_rank_bf16(tiny_target, inputs, tmp_path_factory):
    store = tmp_path_factory.mktemp("one") / "store"
    job.run(make_config(tiny_target, inputs, store, *job_overrides("bf16")))
    return store


def test_two_ranks_under_torchrun_write_the_same_store_as_one(
    one_rank_bf16, tiny_target, inputs, tmp_path
):
    store = tmp_path / "store"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "precompute.cli",
        *cli_args(tiny_target, inputs, store, "bf16"),
    ]
    done = subprocess.run(
        cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[rank 1]" in done.stderr and done.stdout.count("plan:") == 1  # rank 0 alone prints
    summary = Store.open(store).summary
    assert summary["runs"][0]["world_size"] == 2 and summary["runs"][0]["units_written"] == 12
    one, two = store_files(one_rank_bf16), store_files(store)
    assert len([k for k in one if k.endswith("layer_1/c/0/0")]) == 12
    assert one == two
    assert (tmp_path / "store.precompute.toml").is_file() and (
        tmp_path / "store.precompute.json"
    ).is_file()


def test_a_rerun_writes_nothing_new(one_rank_bf16, tiny_target, inputs):
    before, files = _shard_stamps(one_rank_bf16), store_files(one_rank_bf16)
    job.run(make_config(tiny_target, inputs, one_rank_bf16, *job_overrides("bf16")))
    assert _shard_stamps(one_rank_bf16) == before and store_files(one_rank_bf16) == files
    runs = Store.open(one_rank_bf16).summary["runs"]
    assert (
        runs[-1]["units_written"] == 0
        and runs[-1]["batches"] == 0
        and runs[-1]["units_already_in_store"] == 12
    )
    assert (
        runs[-1]["seconds"]["load_target"] == 0
    )  # nothing to compute: the target is not even loaded


def test_inputs_moved_elsewhere_resume_their_store_and_write_nothing(
    one_rank_bf16, tiny_target, inputs, tmp_path
):
    # sample ids name files without their paths: another
    # mount point, or a copy, names the same shards
    moved = [str(shutil.copy(p, tmp_path / Path(p).name)) for p in inputs]
    assert [str(Path(p).parent) for p in moved] != [str(Path(p).parent) for p in inputs]
    store = shutil.copytree(one_rank_bf16, tmp_path / "store")
    files = store_files(store)
    job.run(make_config(tiny_target, moved, store, *job_overrides("bf16")))
    assert store_files(store) == files
    assert Store.open(store).summary["runs"][-1]["units_already_in_store"] == 12


def test_a_unit_stored_under_another_name_is_refused_not_written_twice(
    one_rank_bf16, tiny_target, inputs, tmp_path
):
    store = shutil.copytree(one_rank_bf16, tmp_path / "store")
    first = sorted(p for p in (store / "shards").iterdir() if p.name.startswith("u00000000-"))[0]
    first.rename(first.with_name("u00000000-" + "0" * 16))  # unit 0 from other records
    with pytest.raises(
        UserError, match="already holds work unit 0 as shard u00000000-0000000000000000"
    ):
        job.run(make_config(tiny_target, inputs, store, *job_overrides("bf16")))
    assert len(list((store / "shards").glob("u00000000-*"))) == 1  # nothing written beside it


def test_a_job_killed_mid_way_resumes_to_the_store_of_an_uninterrupted_job(
    tiny_target, inputs, tmp_path
):
    straight = tmp_path / "straight"
    job.run(make_config(tiny_target, inputs, straight, *job_overrides("fp8_e4m3")))
    killed = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "precompute.cli",
        *cli_args(tiny_target, inputs, killed, "fp8_e4m3"),
        "--run.writer_threads=1",
        "--run.queue_depth=1",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    published = _wait_for_first_shard(killed / "shards", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    published = len([p for p in (killed / "shards").iterdir() if p.is_dir()])
    assert 0 < published < 12, "the job was not killed mid-way"
    job.run(make_config(tiny_target, inputs, killed, *job_overrides("fp8_e4m3")))
    assert store_files(killed) == store_files(straight)
    assert Store.open(killed).summary["runs"][-1]["units_written"] == 12 - published
    assert not any((killed / ".staging").iterdir())  # the killed writer's leftovers are gone


def _wait_for_first_shard(shards: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        if shards.is_dir() and any(p.is_dir() for p in shards.iterdir()):
            return
        if proc.poll() is not None:
            pytest.fail(
                f"the job ended before writing a shard: {proc.stderr.read().decode()[-2000:]}"
            )
        time.sleep(0.002)
    proc.kill()
    pytest.fail("no shard appeared within 120 s")
