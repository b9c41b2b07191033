"""Helpers shared by the precompute tests: small JSONL inputs and configs on the tiny targets, the
command line of short dflash-precompute processes, and the bytes of a finished store."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from dflash_common.config import load_config
from precompute.config import PrecomputeConfig
from precompute.inputs import resolve_inputs
from precompute.tokenizing import TokenCache, tokenize_units

ROOT = Path(__file__).resolve().parents[2]
TINY_DATA = ROOT / "data" / "tiny-train.jsonl"


def chat(i: int, answer_len: int = 40) -> dict:
    """A conversation whose answer has `answer_len` + 1 response tokens
    (byte tokenizer + <|im_end|>)."""
    answer = (f"answer {i} " * 40)[:answer_len]
    return {
        "messages": [
            {"role": "user", "content": f"question {i}?"},
            {"role": "assistant", "content": answer},
        ]
    }


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def make_config(target, inputs, store, *overrides: str) -> PrecomputeConfig:
    """A config on `target` with small units and lengths; `overrides` are 'section.field=value'."""
    args = [
        f"--target.path={json.dumps(str(target))}",
        f"--data.inputs={json.dumps(list(inputs))}",
        f"--store.path={json.dumps(str(store))}",
        "--data.block_size=4",
        "--data.max_length=256",
        "--batching.token_budget=1024",
        "--run.samples_per_unit=4",
        "--target.dtype=fp32",
        "--run.device=cpu",
    ]
    return load_config(PrecomputeConfig, None, args + [f"--{o}" for o in overrides])


def tokenize(cfg: PrecomputeConfig, rank: int = 0, world: int = 1):
    """-> ((this rank's unit summaries, input records), the token cache) of a config's inputs."""
    sources = resolve_inputs(cfg.data.inputs)
    cache = TokenCache.for_config(cfg, sources)
    return tokenize_units(cfg, sources, cache, rank, world), cache


def demo_inputs(directory: Path) -> list[str]:
    """The first 48 demo records (responses of the tiny target), as two input files."""
    lines = TINY_DATA.read_text().splitlines(keepends=True)[:48]
    (directory / "a.jsonl").write_text("".join(lines[:30]))
    (directory / "b.jsonl").write_text("".join(lines[30:]))
    return [str(directory / "a.jsonl"), str(directory / "b.jsonl")]


def job_overrides(store_dtype: str, samples_per_unit: int = 4) -> list[str]:
    """Overrides of a short job over `demo_inputs`: with 4 samples per unit, 12 units in windows of
    2, so 6 windows, 3 per rank with 2 ranks, several batches each."""
    return [
        "data.max_length=512",
        "batching.token_budget=512",
        "batching.sort_window_units=2",
        f"run.samples_per_unit={samples_per_unit}",
        "target.dtype=bf16",
        f'store.dtype="{store_dtype}"',
        "run.progress=false",
    ]


def cli_args(
    target, inputs, store, store_dtype: str, *extra: str, samples_per_unit: int = 4
) -> list[str]:
    """dflash-precompute's arguments for the job `make_config(..., *job_overrides(store_dtype,
    samples_per_unit))` runs in process (the shipped tiny config plus overrides); `extra` are
    further `--section.field=value`."""
    cfg_args = [
        f"--target.path={target}",
        f"--data.inputs={json.dumps(inputs)}",
        "--data.block_size=4",
        "--run.device=cpu",
    ] + [f"--{o}" for o in job_overrides(store_dtype, samples_per_unit)]
    return ["--config", str(ROOT / "configs" / "tiny.toml"), "--out", str(store), *cfg_args, *extra]


def subprocess_env() -> dict[str, str]:
    """One intra-op thread, as in the tests' own
    process: the same float reductions, the same bits."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def store_files(path: Path) -> dict[str, str]:
    """sha256 of every file of every shard, and the
    manifest (root attributes without the summary)."""
    out = {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted((path / "shards").rglob("*"))
        if f.is_file()
    }
    attrs = json.loads((path / "zarr.json").read_text())["attributes"]
    attrs.pop("summary")
    out["manifest"] = json.dumps(attrs, sort_keys=True)
    return out


def shard_sums(store: Path, names: list[str]) -> dict[str, str]:
    """sha256 of every file of the shards `names`."""
    return {
        str(f.relative_to(store)): hashlib.sha256(f.read_bytes()).hexdigest()
        for name in names
        for f in sorted((store / "shards" / name).rglob("*"))
        if f.is_file()
    }


def published(store: Path) -> list[str]:
    """The shard names a reader sees (hidden names are never published)."""
    shards = store / "shards"
    return (
        sorted(p.name for p in shards.iterdir() if p.is_dir() and not p.name.startswith("."))
        if shards.is_dir()
        else []
    )


def interrupt_says_what_is_kept(proc: subprocess.Popen, out: Path) -> None:
    """Send SIGINT to a running CLI job writing shards into `out`: it must exit 130 without a
    traceback, its last line the one sentence saying what is kept and how to resume
    (dflash_common.cli's)."""
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last == (
        f"interrupted: the shards already published in {out} are kept (a shard being written is "
        "not visible); rerun the same command to resume."
    ), err


def kill_process_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and every process below it, as a preempted node loses them: torchrun starts
    each worker in a session of its own, so killing torchrun's process group alone would leave them
    running. `proc` is stopped first, so that it starts no worker between the listing and the kill,
    and the call returns once every process of the tree is gone: one killed inside a disk write (an
    fsync) dies only when the write returns, and holds its file locks until then (a rerun found the
    store still locked)."""
    _signal(lambda: os.kill(proc.pid, signal.SIGSTOP))
    tree = [proc.pid, *_descendants(proc.pid)]
    for pgid in dict.fromkeys(_pgid(pid) for pid in tree):
        if pgid is not None and pgid != os.getpgrp():  # never the test's own group
            _signal(lambda: os.killpg(pgid, signal.SIGKILL))
    for pid in tree:  # in a group of its own that another process leads
        _signal(lambda: os.kill(pid, signal.SIGKILL))
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    for pid in tree[1:]:
        while _alive(pid):
            assert time.monotonic() < deadline, f"process {pid} outlived its SIGKILL by 30 s"
            time.sleep(0.01)


def _alive(pid: int) -> bool:
    """True while `pid` runs or dies; a zombie has closed its files (and released its locks)."""
    fields = _stat(Path(f"/proc/{pid}"))
    return fields is not None and fields[0] != b"Z"


def _stat(proc_dir: Path) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command
    name (state, ppid, ...), None once it is gone."""
    try:
        stat = (proc_dir / "stat").read_bytes()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(entry)) is not None:
            children.setdefault(int(fields[1]), []).append(
                int(entry.name)
            )  # fields: state, ppid, ...
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _signal(send) -> None:
    try:
        send()
    except (ProcessLookupError, PermissionError):
        pass
