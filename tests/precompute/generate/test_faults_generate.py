"""dflash-generate stopped mid-job by Ctrl-C, by SIGKILL and by a full disk: the shards published so
far are kept and whole (nothing half-written is visible), Ctrl-C and a full disk end in one sentence
naming the output directory and how to resume, and rerunning the same command ends with the files of
an uninterrupted run (shards, per-unit counts and the manifest, its log of runs aside) without
writing a published shard again.

The job: 24 one-record work units in windows of 2, answers of up to 64 tokens on the tiny target, a
few seconds of decoding, so a signal sent once the first shard is published lands mid-job."""

from __future__ import annotations

import errno
import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from precompute.generate import job
from precompute.generate.cli import main, parse
from precompute.inputs import resolve_inputs

from precompute_helpers import (
    ROOT,
    interrupt_says_what_is_kept,
    kill_process_tree,
    subprocess_env,
    write_jsonl,
)

UNITS = (
    24  # one record each (run.samples_per_unit = 1): many small units, each published on its own
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen-fault-inputs")
    records = [{"prompt": f"question {i} about owls?"} for i in range(UNITS - 4)]
    records += [
        {
            "messages": [
                {"role": "user", "content": f"hello {i}"},
                {"role": "assistant", "content": "old"},
                {"role": "user", "content": "and then?"},
                {"role": "assistant", "content": "old"},
            ]
        }
        for i in range(4)
    ]
    return [write_jsonl(d / "prompts.jsonl", records)]


def _args(target, inputs, out) -> list[str]:
    return [
        "--out",
        str(out),
        f"--target.path={target}",
        f"--data.inputs={json.dumps(inputs)}",
        "--target.dtype=fp32",
        "--run.device=cpu",
        "--run.samples_per_unit=1",
        "--generate.sort_window_units=2",
        "--sampling.max_new_tokens=64",
        "--run.progress=false",
    ]


@pytest.fixture(scope="module")
def reference(tiny_target, inputs, tmp_path_factory):
    """The output of an uninterrupted run."""
    out = tmp_path_factory.mktemp("gen-reference") / "gen"
    job.run(parse(_args(tiny_target, inputs, out)))
    assert len(_published(out)) == UNITS
    return out


def _published(out: Path) -> list[str]:
    """The shards a reader sees (dflash-precompute reads `*.jsonl`, never hidden names)."""
    return sorted(p.name for p in out.glob("u*.jsonl"))


def _sums(out: Path, names: list[str]) -> dict[str, str]:
    """sha256 of the shards `names` and of their per-unit counts."""
    files = [out / n for n in names] + [out / job.UNIT_STATS / f"{n}.json" for n in names]
    return {str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def _output_files(out: Path) -> dict[str, str]:
    """Every shard and its counts, and the manifest
    without its log of runs (times, counts of this run)."""
    manifest = json.loads((out / job.MANIFEST).read_text())
    manifest.pop("runs")
    return {**_sums(out, _published(out)), "manifest": json.dumps(manifest, sort_keys=True)}


def _identities(out: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of each shard: a shard written
    again is a new file renamed over the old one."""
    return {n: ((out / n).stat().st_ino, (out / n).stat().st_mtime_ns) for n in names}


def _leftovers(out: Path) -> list[str]:
    return sorted(
        str(p.relative_to(out)) for d in (out, out / job.UNIT_STATS) for p in d.glob(".*.tmp-*")
    )


def _nothing_partial_visible(out: Path, reference: Path) -> list[str]:
    """Every visible shard and its counts hold the uninterrupted run's bytes, and dflash-precompute
    reading the directory sees those shards only; -> their names."""
    seen = _published(out)
    assert set(seen) < set(_published(reference))
    assert _sums(out, seen) == _sums(reference, seen)
    assert [s.path for s in resolve_inputs([str(out)])] == [str(out / n) for n in seen]
    return seen


def _finishes_as_the_reference(args, out: Path, reference: Path, capsys) -> dict:
    """Rerun the command in this process: the uninterrupted run's files, no temporary file left; ->
    the manifest's entry of this run."""
    main(args)
    assert "done:" in capsys.readouterr().out
    assert _output_files(out) == _output_files(reference)
    assert not _leftovers(out)
    return json.loads((out / job.MANIFEST).read_text())["runs"][-1]


def _start(args, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "precompute.generate.cli", *args],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _wait_for_shards(out: Path, proc: subprocess.Popen, count: int) -> None:
    deadline = time.monotonic() + 120
    while len(_published(out)) < count:
        if proc.poll() is not None:
            pytest.fail(
                f"the job ended before publishing {count} shards: {proc.stderr.read()[-3000:]}"
            )
        if time.monotonic() > deadline:
            kill_process_tree(proc)
            pytest.fail(f"fewer than {count} shards appeared within 120 s")
        time.sleep(0.002)


def test_ctrl_c_mid_job_is_one_sentence_exit_130_and_the_rerun_finishes_the_same_files(
    tiny_target, inputs, reference, tmp_path, capsys
):
    out = tmp_path / "interrupted"
    args = _args(tiny_target, inputs, out)
    # SIGINT at its default in the child: a test run started in the background of a non-interactive
    # shell (`make test &`) ignores SIGINT, the child would inherit that, and Python then installs
    # no handler
    proc = _start(args, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for_shards(out, proc, 1)
    interrupt_says_what_is_kept(proc, out)
    seen = _nothing_partial_visible(out, reference)
    assert 0 < len(seen) < UNITS, "the job had finished before the interrupt"
    kept = _identities(out, seen)
    run = _finishes_as_the_reference(args, out, reference, capsys)
    assert run["units_written"] == UNITS - len(seen) and run["units_already_written"] == len(seen)
    assert _identities(out, seen) == kept  # the rerun skipped the published shards


def test_sigkill_mid_job_twice_leaves_only_whole_shards_and_the_rerun_skips_them(
    tiny_target, inputs, reference, tmp_path, capsys
):
    out = tmp_path / "killed"
    args = _args(tiny_target, inputs, out)
    kept: dict[str, tuple[int, int]] = {}
    for more in (2, 3):  # the second kill hits a resumed run, a few shards after its own start
        proc = _start(args, start_new_session=True)
        _wait_for_shards(out, proc, len(kept) + more)
        kill_process_tree(proc)
        seen = _nothing_partial_visible(out, reference)
        assert len(seen) < UNITS, "the job had finished before the kill"
        assert {
            n: i for n, i in _identities(out, seen).items() if n in kept
        } == kept  # none written again
        kept = _identities(out, seen)
    name = _published(reference)[-1]
    cut = out / f".{name}.tmp-1-0123abcd"  # as a kill inside a shard's write leaves it
    cut.write_text('{"id": "cut')
    _nothing_partial_visible(out, reference)  # a reader never takes it for a shard
    run = _finishes_as_the_reference(args, out, reference, capsys)  # and the rerun removes it
    assert run["units_written"] == UNITS - len(kept) and run["units_already_written"] == len(kept)
    assert _identities(out, list(kept)) == kept


def _full_disk_sentence(args, out: Path, capsys) -> str:
    with pytest.raises(SystemExit) as caught:
        main(args)
    err = capsys.readouterr().err  # log lines, then the error
    assert caught.value.code == 2 and "Traceback" not in err and err.count("error: ") == 1, err
    last = err.strip().splitlines()[-1]
    assert last == (
        f"error: the filesystem of {out} is full (No space left on device); free space and rerun "
        "the same command: published shards are kept and the job resumes."
    ), err
    return last


def test_a_real_full_disk(small_disk, tiny_target, inputs, reference, capsys):
    # 26 pages: the manifest and the run record's two files (a page each), 11 units (a shard and its
    # counts, a page each) and the 12th unit's counts; the disk fills while that unit's shard is
    # written
    disk = small_disk("104k")
    out = disk.path / "gen"
    args = _args(tiny_target, inputs, out)
    _full_disk_sentence(args, out, capsys)
    seen = _nothing_partial_visible(out, reference)
    assert 0 < len(seen) < UNITS
    cut = _published(reference)[len(seen)]
    assert [p.split(".tmp-")[0] for p in _leftovers(out)] == [
        f".{cut}"
    ]  # it was cut aside, under a hidden name
    kept = _identities(out, seen)
    disk.resize("1m")  # space is freed
    run = _finishes_as_the_reference(args, out, reference, capsys)
    assert run["units_written"] == UNITS - len(seen)
    assert _identities(out, seen) == kept


class FillingDisk:
    """`open` for dflash_common.fsutil's writes to a disk with `budget` bytes left: a write past it
    puts what still fits into the file, then fails as a full disk does."""

    def __init__(self, budget: int):
        self.budget = budget

    def __call__(self, path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return _FillingFile(f, self) if "w" in mode else f


class _FillingFile:
    def __init__(self, f, disk: FillingDisk):
        self.f, self.disk = f, disk

    def write(self, data) -> int:
        fits = max(0, min(len(data), self.disk.budget))
        self.disk.budget -= len(data)
        self.f.write(data[:fits])
        if fits < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(data)

    def __getattr__(self, name):  # flush, fileno, close
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def test_an_injected_full_disk_in_a_shard_then_in_the_manifest(
    tiny_target, inputs, reference, tmp_path, capsys, monkeypatch
):
    import dflash_common.fsutil as fsutil

    out = tmp_path / "gen"
    args = _args(tiny_target, inputs, out)
    record = sum(
        (reference / n).stat().st_size
        for n in (job.MANIFEST, "generate.run.toml", "generate.run.json")
    )
    units = sum(f.stat().st_size for f in (reference / job.UNIT_STATS).iterdir()) + sum(
        (reference / n).stat().st_size for n in _published(reference)
    )
    monkeypatch.setattr(
        fsutil, "open", FillingDisk(record + units // 2), raising=False
    )  # about half the units fit
    _full_disk_sentence(args, out, capsys)
    seen = _nothing_partial_visible(out, reference)
    assert 0 < len(seen) < UNITS
    monkeypatch.undo()

    real = fsutil.atomic_write_bytes

    def no_space_for_the_manifest(path, data, **k):
        if Path(path).name == job.MANIFEST:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data, **k)

    monkeypatch.setattr(
        fsutil, "atomic_write_bytes", no_space_for_the_manifest
    )  # every shard fits, the manifest not
    _full_disk_sentence(args, out, capsys)
    assert _published(out) == _published(reference)
    monkeypatch.undo()
    run = _finishes_as_the_reference(args, out, reference, capsys)
    assert run["units_written"] == 0 and run["units_already_written"] == UNITS
