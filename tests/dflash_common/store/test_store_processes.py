"""Real writer processes: one killed mid-shard leaves nothing visible; two at once share a store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from test_store_support import manifest, payload, unit_name

from dflash_common.store import Store, StoreWriter
from dflash_common.store.verify import verify_store

SUPPORT = Path(__file__).with_name("test_store_support.py")


def _writer(
    store: Path,
    first: int,
    count: int,
    tokens: int,
    hidden: int,
    *extra: str,
    dtype: str = "bf16",
    codec: str = "none",
) -> subprocess.Popen:
    args = [
        sys.executable,
        str(SUPPORT),
        str(store),
        dtype,
        codec,
        str(first),
        str(count),
        str(tokens),
        str(hidden),
        *extra,
    ]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _staging_has_data(store: Path) -> bool:
    staging = store / ".staging"
    return staging.is_dir() and any(staging.glob("*/layer_*/c"))  # a shard is being written


def test_a_writer_killed_mid_shard_leaves_no_visible_shard(tmp_path):
    store = tmp_path / "s"
    proc = _writer(store, 0, 0, 4096, 1024, "--forever")  # 24 MiB shards: tens of ms each to write
    deadline = time.monotonic() + 60
    published = 0
    try:
        while time.monotonic() < deadline:  # kill it inside a shard, after at least one publish
            published = (
                len(list((store / "shards").glob("u*"))) if (store / "shards").is_dir() else 0
            )
            if published >= 1 and _staging_has_data(store):
                break
            time.sleep(0.002)
        assert published >= 1 and _staging_has_data(store), "the writer never got going"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert any((store / ".staging").iterdir())  # the half shard is there, hidden
    with Store.open(store) as s:
        names = [i.name for i in s.shards]
        assert names == [unit_name(u) for u in range(len(names))]  # complete shards only
        report = verify_store(s)
        assert report.ok and report.shards_checked == len(names) and report.staging
        s.read_shard(names[-1])
    StoreWriter.create_or_open(store, manifest(hidden=1024))  # the next writer cleans up
    assert not any((store / ".staging").iterdir())


def test_two_processes_write_one_store(tmp_path):
    store = tmp_path / "s"
    go = tmp_path / "go"
    # overlapping ranges: units 10-19 are written by both, as after a rerun or a shared unit list
    procs = [
        _writer(store, first, 20, 300, 64, "--go", str(go), dtype="fp8_e4m3", codec="zstd")
        for first in (0, 10)
    ]
    for proc in procs:  # both have created-or-opened the store (racing on its creation)
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    go.touch()
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    m = manifest("fp8_e4m3", "zstd")
    with Store.open(store) as s:
        assert [i.name for i in s.shards] == sorted(unit_name(u) for u in range(30))
        assert verify_store(s).ok
        for unit in (0, 12, 29):
            want, _ = payload(unit, 300, m)
            got = s.read_shard(unit_name(unit))
            assert np.array_equal(got.layers[3], want.layers[3].data.numpy())
            assert got.sample_ids == list(want.sample_ids)
    assert not any((store / ".staging").iterdir())
