"""dflash-precompute SIGKILLed at random points (every process of the job at once, as a preempted
node loses them), resumed each time by the same command, with two ranks and with one: the finished
store is the store of an uninterrupted run, shard by shard and byte by byte (so checksum by
checksum).

One job, five kills, in this order: in start-up; in the plan (the token cache being written); three
times while shards are written, a random number of shards after the run's start. Kills 1-3 and 5 hit
a two-rank job under torchrun (gloo, CPU), kill 4 a one-rank job, and one rank finishes: the store
goes from two ranks to one and back and to one again. (The name differs from
train/test_faults_killed.py: test modules are imported by their base name.)"""

from __future__ import annotations

import fcntl
import random
import subprocess
import sys
import time
from pathlib import Path

from dflash_common.dirlock import LOCK_FILE
from dflash_common.store import Store
from dflash_common.store.verify import verify_store
from precompute import job

from precompute_helpers import (
    ROOT,
    cli_args,
    demo_inputs,
    job_overrides,
    kill_process_tree,
    make_config,
    published,
    shard_sums,
    store_files,
    subprocess_env,
)

SEED = 20240611  # the kill points are random, but the same in every run of the test
SAMPLES_PER_UNIT = 2  # 48 records -> 24 shards in 12 windows: room for three kills while writing
UNITS = 24


class Job:
    """A dflash-precompute process (under torchrun when `ranks` > 1), its stderr in a file."""

    def __init__(self, target, inputs, store: Path, ranks: int, log: Path):
        launcher = (
            [sys.executable]
            if ranks == 1
            else [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={ranks}",
            ]
        )
        cmd = [
            *launcher,
            "-m",
            "precompute.cli",
            *cli_args(target, inputs, store, "bf16", samples_per_unit=SAMPLES_PER_UNIT),
        ]
        self.log, self.store = log, store
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=subprocess_env(),
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
        self.started = time.monotonic()

    def kill_when(self, ready, timeout: float = 120.0) -> None:
        """Poll `ready()` and SIGKILL the whole job once it is true; the job must not end first."""
        deadline = self.started + timeout
        while not ready():
            assert self.proc.poll() is None, f"the job ended before its kill point:\n{self.text()}"
            assert time.monotonic() < deadline, f"the job made no progress:\n{self.text()}"
            time.sleep(0.002)
        assert self.proc.poll() is None, f"the job ended before its kill point:\n{self.text()}"
        kill_process_tree(self.proc)
        self._wait_unlocked()

    def _wait_unlocked(self, timeout: float = 30.0) -> None:
        """Return once no process holds the store's lock: a child a rank forked after the tree was
        listed dies by its group's SIGKILL, but it may still be dying (inside an fsync) with the
        lock it inherited, and the next run would find the store in use."""
        path, deadline = self.store / LOCK_FILE, time.monotonic() + timeout
        while path.exists():
            with open(path, "rb") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return  # closing the file releases it
                except BlockingIOError:
                    assert time.monotonic() < deadline, f"{path} still held {timeout:.0f} s on"
            time.sleep(0.01)

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _token_files(store: Path) -> int:
    cache = Path(f"{store}.tokens")
    return sum(1 for _ in cache.rglob("unit-*.npz")) if cache.is_dir() else 0


def _kill_points(rng: random.Random, store: Path):
    """(ranks, description, ready) of each kill; `ready` is made when its run starts."""

    def in_start_up(job: Job):
        delay = rng.uniform(
            0.2, 2.0
        )  # torchrun and the imports take longer: before anything is written
        return lambda: time.monotonic() - job.started > delay or _token_files(store) > 0

    def in_plan(job: Job):
        before = _token_files(store)
        return lambda: _token_files(store) > before or len(published(store)) > 0

    def while_writing(job: Job):
        target = min(len(published(store)) + rng.randint(1, 5), UNITS - 3)
        return lambda: len(published(store)) >= target

    return [
        (2, "start-up", in_start_up),
        (2, "plan", in_plan),
        (2, "writing", while_writing),
        (1, "writing", while_writing),
        (2, "writing", while_writing),
    ]


def test_five_random_sigkills_of_two_ranks_and_one_then_one_rank_finishes_the_same_store(
    tiny_target, tmp_path
):
    inputs = demo_inputs(tmp_path)
    reference = tmp_path / "reference"
    job.run(make_config(tiny_target, inputs, reference, *job_overrides("bf16", SAMPLES_PER_UNIT)))
    names = published(reference)
    expected = store_files(reference)
    assert len(names) == UNITS

    store, rng, schedule = tmp_path / "killed", random.Random(SEED), []
    for i, (ranks, where, make_ready) in enumerate(_kill_points(rng, store)):
        run = Job(tiny_target, inputs, store, ranks, tmp_path / f"run{i}.log")
        before = len(published(store))
        run.kill_when(make_ready(run))
        seen = published(store)
        schedule.append((ranks, where, before, len(seen), _token_files(store)))
        assert set(seen) <= set(names) and len(seen) < UNITS, schedule
        # what a reader sees after a kill is whole: every visible shard holds the reference's bytes
        assert shard_sums(store, seen) == shard_sums(reference, seen), schedule

    assert any(after > before for _, where, before, after, _ in schedule if where == "writing"), (
        schedule
    )
    left = UNITS - len(published(store))
    cache = next(Path(f"{store}.tokens").iterdir())
    (cache / ".unit-00000000.npz.tmp-1-0123abcd").write_bytes(
        b"cut"
    )  # as a kill inside a save leaves it
    job.run(
        make_config(tiny_target, inputs, store, *job_overrides("bf16", SAMPLES_PER_UNIT))
    )  # one rank

    assert store_files(store) == expected, schedule
    finished = Store.open(store)
    assert verify_store(finished).bad == {}  # every chunk's crc32c, every file's size
    assert (
        finished.summary["runs"][-1]["units_written"] == left and finished.summary["samples"] == 48
    )
    assert not any((store / ".staging").iterdir())  # the killed writers' leftovers are gone
    assert not list(Path(f"{store}.tokens").rglob(".*")), "a cut token cache save was left behind"
