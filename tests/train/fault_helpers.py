"""Helpers of the fault tests (no tests here): damaging a store the ways disks and people do."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Each kind of damage, as it happens: a bit flips on disk, a copy is cut short, a file goes missing.
CORRUPTIONS = (
    "flipped_byte",
    "truncated_file",
    "missing_shard_metadata",
    "missing_array_metadata",
    "missing_array_file",
)


def corrupt(store: Path, name: str, kind: str) -> None:
    """Damage shard `name` of `store` in one way of CORRUPTIONS."""
    shard = store / "shards" / name
    if (
        kind == "flipped_byte"
    ):  # one bit inside a state chunk's data (not its checksum or the index)
        path = shard / "layer_3" / "c" / "0" / "0"
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x10
        path.write_bytes(bytes(data))
    elif kind == "truncated_file":
        path = shard / "layer_5" / "c" / "0" / "0"
        os.truncate(path, path.stat().st_size // 2)
    elif kind == "missing_shard_metadata":
        (shard / "zarr.json").unlink()
    elif kind == "missing_array_metadata":
        (shard / "layer_4" / "zarr.json").unlink()
    elif kind == "missing_array_file":
        (shard / "layer_2" / "c" / "0" / "0").unlink()
    else:
        raise ValueError(kind)


def copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def shard_names(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "shards").iterdir() if p.is_dir())


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "train.cli", *args]


def subprocess_env(**extra: str) -> dict[str, str]:
    """One intra-op thread: the same float reductions in every process, so losses compare bit for
    bit."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
