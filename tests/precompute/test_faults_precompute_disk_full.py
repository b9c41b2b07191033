"""dflash-precompute on a full disk: one sentence (exit 2, no traceback) saying what filled up and
that rerunning resumes, no partial shard visible, and once space is freed the same command finishes
the store of an uninterrupted run. On a real small filesystem (a tmpfs, where mounting one is
allowed), with one process and with two ranks under torchrun; and with the errors injected
(everywhere): in the shard writer, then in the summary."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

import dflash_common.store.chunks as store_chunks
from dflash_common.store import Store, StoreWriter
from precompute import job
from precompute.cli import main

from precompute_helpers import (
    ROOT,
    cli_args,
    demo_inputs,
    job_overrides,
    make_config,
    published,
    shard_sums,
    store_files,
    subprocess_env,
)

UNITS = 12  # of demo_inputs with job_overrides' 4 samples per unit


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return demo_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def reference(tiny_target, inputs, tmp_path_factory):
    store = tmp_path_factory.mktemp("reference") / "store"
    job.run(make_config(tiny_target, inputs, store, *job_overrides("bf16")))
    return store


def _fails_with_one_sentence(args, capsys) -> str:
    with pytest.raises(SystemExit) as caught:
        main(args)
    err = capsys.readouterr().err  # log lines, then the error
    assert caught.value.code == 2 and "Traceback" not in err and err.count("error: ") == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err
    return last


def _nothing_partial_visible(store, reference, staging_left: bool = False) -> list[str]:
    """Every visible shard is whole (the reference's bytes); no staging dir is left (`staging_left`:
    unless a process was terminated from outside mid-write); -> their names."""
    seen = published(store)
    assert set(seen) < set(published(reference))
    assert shard_sums(store, seen) == shard_sums(reference, seen)
    assert staging_left or not any((store / ".staging").iterdir())
    return seen


def _finishes_as_the_reference(args, store, reference, written_before: int) -> None:
    main(args)
    assert store_files(store) == store_files(reference)
    assert Store.open(store).summary["runs"][-1]["units_written"] == UNITS - written_before


def test_a_real_full_disk(small_disk, tiny_target, inputs, reference, capsys):
    disk = small_disk("2m")  # the token cache and a few of the ~4.7 MB of shards fit
    store = disk.path / "store"
    args = cli_args(tiny_target, inputs, store, "bf16")
    refused = _fails_with_one_sentence(args, capsys)  # the plan sees that the store will not fit
    assert "--run.force=true" in refused and not (store / "shards").exists()

    err = _fails_with_one_sentence(args + ["--run.force=true"], capsys)
    assert "is full" in err and "No space left on device" in err and "rerun" in err, err
    seen = _nothing_partial_visible(store, reference)
    disk.resize("16m")
    _finishes_as_the_reference(args, store, reference, len(seen))


def test_a_real_full_disk_under_two_ranks(small_disk, tiny_target, inputs, reference):
    disk = small_disk("2m")
    store = disk.path / "store"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "precompute.cli",
        *cli_args(tiny_target, inputs, store, "bf16", "--run.force=true"),
    ]
    done = subprocess.run(
        cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0, done.stderr
    # each rank that hit the full disk says so in one sentence (torchrun then adds its own report)
    ours = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert 1 <= len(ours) <= 2 and all(
        "filesystem is full" in e and "rerunning the same command resumes" in e for e in ours
    ), done.stderr
    tracebacks = done.stderr.split("Traceback (most recent call last)")[1:]
    assert len(tracebacks) == 1 and "ChildFailedError" in tracebacks[0], (
        done.stderr
    )  # torchrun's, none of ours
    # torchrun terminates the other rank when one fails, perhaps mid-write: its staging dir may stay
    seen = _nothing_partial_visible(store, reference, staging_left=True)
    disk.resize("16m")
    done = subprocess.run(
        cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert store_files(store) == store_files(reference)
    assert not any(
        (store / ".staging").iterdir()
    )  # a dead process's staging is cleaned by the rerun
    assert Store.open(store).summary["runs"][-1]["units_written"] == UNITS - len(seen)


def test_an_injected_full_disk_in_the_writer_then_in_the_summary(
    tiny_target, inputs, reference, tmp_path, capsys, monkeypatch
):
    real_write, budget = store_chunks._write_all, [1_500_000]  # bytes: about 4 of the 12 shards

    def filling_disk(fd, data):  # once the budget is spent every write fails, as on a full disk
        budget[0] -= len(data)
        if budget[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, data)

    monkeypatch.setattr(store_chunks, "_write_all", filling_disk)
    store = tmp_path / "store"
    args = cli_args(tiny_target, inputs, store, "bf16")
    err = _fails_with_one_sentence(args, capsys)
    assert err.startswith("error: the store's filesystem is full while writing shard u0000"), err
    assert "(No space left on device)" in err and "nothing of that shard is visible" in err, err
    assert "rerunning the same command resumes" in err, err
    seen = _nothing_partial_visible(store, reference)
    assert 0 < len(seen) < UNITS
    monkeypatch.setattr(store_chunks, "_write_all", real_write)

    def no_space(self, summary):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path / "zarr.json"))

    monkeypatch.setattr(StoreWriter, "write_summary", no_space)  # every shard fits, the summary not
    err = _fails_with_one_sentence(args, capsys)
    assert err.startswith(f"error: the filesystem of {store} is full (No space left on device)"), (
        err
    )
    assert published(store) == published(reference)
    monkeypatch.undo()
    _finishes_as_the_reference(args, store, reference, UNITS)
