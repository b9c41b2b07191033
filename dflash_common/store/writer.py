"""Writing a store: create or open it, write shards aside and publish each with one rename.

Any number of processes (ranks, nodes) write one store at once without locks: each shard is built
in `.staging/<name>~<host>~<pid>~<rand>`, fsynced, and renamed to `shards/<name>`; the rename fails
on an existing shard, so the first writer of a unit wins and a rerun of the unit skips it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.storage import LocalStore

from dflash_common.fsutil import atomic_write_bytes, fsync_dir, fsync_tree, publish_dir
from dflash_common.store.chunks import balanced_chunk_rows, create_array, write_data
from dflash_common.store.format import (
    FINAL_ARRAY, FINAL_SCALE_ARRAY, FORMAT_NAME, SHARDS_DIR, STAGING_DIR, STALE_STAGING_S, NonFiniteStatesError, ShardInfo,
    ShardPayload, StoreError, StoreManifest, StoreMismatchError, check_shard_name, group_metadata, layer_array,
    read_json, read_root_attributes, scale_array, short_json,
)
from dflash_common.store.quant import (
    LOGICAL_DTYPE_NAMES, EncodedStates, has_scale, nonfinite_rows, row_size, storage_numpy_dtype,
)
from dflash_common.store.reader import Store


def _publish_new_file(path: Path, data: bytes) -> bool:
    """Create `path` with `data` unless it exists (then leave it alone): write aside, fsync, link.
    os.link fails on an existing name, so of racing creators exactly one wins, and no one ever sees
    a partial file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    fsync_dir(path.parent)
    return True


def _differences(old: Any, new: Any, key: str = "") -> Iterator[tuple[str, Any, Any]]:
    """Every (dotted key, old value, new value) where two JSON trees differ, in key order."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            yield from _differences(old.get(k), new.get(k), f"{key}.{k}" if key else k)
    elif old != new:
        yield key, old, new


def _first_difference(old: Any, new: Any) -> tuple[str, Any, Any] | None:
    """The difference a refusal names: the first of content, not of a name (copies of one target
    differ in their directory's name; other weights under another name are refused by weights)."""
    diffs = list(_differences(old, new))
    content = [d for d in diffs if not d[0].endswith(".name")]
    return (content or diffs or [None])[0]


def _staging_owner_dead(entry: os.DirEntry, host: str, now: float) -> bool:
    """A staging dir `<shard>~<host>~<pid>~<rand>` is stale when its writer on this host is gone,
    or (writers on other hosts) when it is older than STALE_STAGING_S."""
    parts = entry.name.rsplit("~", 3)
    if len(parts) == 4 and parts[1] == host and parts[2].isdigit():
        return not _process_alive(int(parts[2]))
    return now - entry.stat(follow_symlinks=False).st_mtime > STALE_STAGING_S


def _process_alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie (killed, not yet reaped: a rank SIGKILLed after its torchrun agent,
    under a PID 1 that reaps late) is dead, though signal 0 still finds it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no /proc here (not Linux), or it just ended
        return True
    return stat[stat.rindex(b")") + 2:][:1] != b"Z"  # the state follows the parenthesised command name


def _host() -> str:
    return socket.gethostname().replace("~", "-").replace("/", "-")


@dataclasses.dataclass(frozen=True)
class WrittenShard(ShardInfo):
    """A shard write's result: False `published` means another writer published this name first and
    its shard was kept (this copy was dropped)."""

    published: bool = True


def check_store_place(path: Path) -> None:
    """A store goes into a new directory, an empty one, or a store: refuse a file and a directory
    holding anything else, before any work (precompute checks this before it tokenizes)."""
    if path.exists() and not path.is_dir():
        raise StoreError(f"store path {path} is a file; pass a directory (new or a dflash store).")
    if not path.is_dir() or (path / "zarr.json").exists():
        return
    foreign = [p.name for p in path.iterdir()
               if not p.name.startswith(".") and p.name not in ("zarr.json", SHARDS_DIR)]
    if foreign:
        raise StoreError(f"{path} is a non-empty directory that is not a dflash store (it holds "
                         f"{foreign[0]!r}); pass a new or empty directory.")


class StoreWriter:
    """Writes shards into one store; any number of processes (and threads) may write one store."""

    def __init__(self, path: Path, manifest: StoreManifest):
        self.path = path
        self.manifest = manifest
        self.shards_dir = path / SHARDS_DIR
        self.staging_dir = path / STAGING_DIR

    @classmethod
    def create_or_open(cls, path: str | Path, manifest: StoreManifest) -> StoreWriter:
        """Create the store, or open it if it holds the same manifest; refuse a different one."""
        path = Path(path)
        check_store_place(path)
        path.mkdir(parents=True, exist_ok=True)
        root_meta = path / "zarr.json"
        if not root_meta.exists():
            _publish_new_file(root_meta, group_metadata(manifest.to_json()))
        attrs = read_root_attributes(path)
        StoreManifest.from_json(attrs, where=f"store {path}")  # refuses other formats and versions
        Store.open(path).close()  # a hand-edited root zarr.json is named as such, not as settings
        stored = {k: v for k, v in attrs.items() if k != "summary"}
        diff = _first_difference(stored, manifest.to_json())
        if diff:
            key, old, new = diff
            fix = ("the dflash version that made it" if key.endswith("_version")  # no setting brings it back
                   else "the settings the store was made with")
            raise StoreMismatchError(
                f"Store {path} was made with {key} = {short_json(old)}, but this run has "
                f"{key} = {short_json(new)}; use a new store path, or {fix}.")
        (path / SHARDS_DIR).mkdir(exist_ok=True)
        if not (path / SHARDS_DIR / "zarr.json").exists():
            _publish_new_file(path / SHARDS_DIR / "zarr.json", group_metadata({}))
        (path / STAGING_DIR).mkdir(exist_ok=True)
        writer = cls(path, manifest)
        writer.clean_stale_staging()
        return writer

    def has_shard(self, name: str) -> bool:
        """True once a shard of this name is published (complete: publishing is one rename)."""
        return (self.shards_dir / name).is_dir()

    def clean_stale_staging(self) -> list[str]:
        """Remove staging dirs of writers that died mid-shard; returns their names."""
        host, now, removed = _host(), time.time(), []
        with os.scandir(self.staging_dir) as entries:
            for entry in entries:
                if _staging_owner_dead(entry, host, now):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(entry.name)
        return removed

    def write_shard(self, name: str, payload: ShardPayload) -> WrittenShard:
        """Write one shard and publish it atomically. NaN/Inf states are refused (naming the sample)
        before anything touches the disk. If the name is already published (a rerun, or another
        writer of the same unit), the shard on disk is kept and this copy dropped: `published` is
        then False."""
        check_shard_name(name)
        arrays, attrs = self._shard_arrays(name, payload)
        staging = self.staging_dir / f"{name}~{_host()}~{os.getpid()}~{uuid.uuid4().hex[:8]}"
        try:
            group = zarr.create_group(store=LocalStore(staging), attributes=attrs, zarr_format=3)
            for array_name, (data, array_attrs, dims, rows) in arrays.items():
                layout = create_array(group, array_name, data.shape, data.dtype, rows, self.manifest.codec,
                                      array_attrs, dims)
                write_data(staging / array_name, layout, data)
            fsync_tree(staging)
            published = publish_dir(staging, self.shards_dir / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone after a publish; a failed write's rest
        return WrittenShard(name, attrs["num_tokens"], attrs["num_sequences"], published)

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        """Add `summary` (totals, timings: anything, it is not part of the manifest) to the root
        attributes with one atomic rewrite. Call it from one process, after all shards are written."""
        root_meta = self.path / "zarr.json"
        attrs = read_json(root_meta)["attributes"]
        attrs["summary"] = json.loads(json.dumps(dict(summary)))
        atomic_write_bytes(root_meta, group_metadata(attrs))

    def _shard_arrays(self, name: str, payload: ShardPayload):
        """Validate a payload -> ({array name: (data, attrs, dimension names, chunk rows)}, group attrs)."""
        m = self.manifest
        input_ids = _numpy(payload.input_ids, "input_ids", np.int32, 1)
        t = len(input_ids)
        loss_mask = _numpy(payload.loss_mask, "loss_mask", np.uint8, 1)
        offsets = _numpy(payload.offsets, "offsets", np.int64, 1)
        sample_ids = [str(s) for s in payload.sample_ids]
        _check_sequences(name, t, loss_mask, offsets, sample_ids)
        if sorted(payload.layers) != list(m.layer_ids):
            raise ValueError(f"shard {name} has layers {sorted(payload.layers)}, the store "
                             f"{list(m.layer_ids)}")
        # small 1-D arrays are one chunk each (T int32 is 0.01% of a layer's bytes at H=4096)
        arrays = {"input_ids": (input_ids, {}, ("token",), t),
                  "loss_mask": (loss_mask, {}, ("token",), t),
                  "offsets": (offsets, {}, ("sequence_boundary",), len(offsets))}
        rows = balanced_chunk_rows(t, m.chunk_tokens)
        for layer_id in m.layer_ids:
            data, scale = self._states(name, f"layer {layer_id}", payload.layers[layer_id], t, offsets, sample_ids)
            attrs = {"layer_id": layer_id, "logical_dtype": LOGICAL_DTYPE_NAMES[m.dtype]}
            if scale is not None:
                attrs["scale_array"] = scale_array(layer_id)
                arrays[scale_array(layer_id)] = (scale, {"layer_id": layer_id}, ("token",), t)
            arrays[layer_array(layer_id)] = (data, attrs, ("token", "hidden"), rows)
        if (payload.final is not None) != m.final_state:
            raise ValueError(f"shard {name} {'lacks' if m.final_state else 'has'} the final state, the store "
                             f"{'holds' if m.final_state else 'does not hold'} final states")
        if m.final_state:
            arrays.update(self._final_arrays(name, payload.final, t, offsets, sample_ids, rows))
        attrs = {"format": FORMAT_NAME + "/shard", "format_version": m.format_version, "num_tokens": t,
                 "num_sequences": len(sample_ids), "layer_ids": list(m.layer_ids), "dtype": m.dtype,
                 "sample_ids": sample_ids}
        if m.final_state:
            attrs["final_state"] = True
        return dict(sorted(arrays.items())), attrs

    def _final_arrays(self, name, enc: EncodedStates, t, offsets, sample_ids, rows):
        """The final state's array (+ its scale), encoded and checked like a layer's."""
        data, scale = self._states(name, "the final state", enc, t, offsets, sample_ids)
        attrs = {"final_state": True, "logical_dtype": LOGICAL_DTYPE_NAMES[self.manifest.dtype]}
        arrays = {FINAL_ARRAY: (data, attrs, ("token", "hidden"), rows)}
        if scale is not None:
            attrs["scale_array"] = FINAL_SCALE_ARRAY
            arrays[FINAL_SCALE_ARRAY] = (scale, {"final_state": True}, ("token",), t)
        return arrays

    def _states(self, name, what, enc: EncodedStates, t, offsets, sample_ids):
        """Check one [T, H] state array of a payload (`what`: 'layer 9', 'the final state')."""
        m = self.manifest
        if enc.dtype != m.dtype:
            raise ValueError(f"shard {name} {what} is encoded as {enc.dtype}, the store as {m.dtype}")
        data = _numpy(enc.data, what, storage_numpy_dtype(m.dtype), 2, exact=True)
        shape = (t, row_size(m.dtype, m.hidden_size))
        if data.shape != shape:
            raise ValueError(f"shard {name} {what} has shape {data.shape}, expected {shape}")
        scale = None
        if has_scale(m.dtype):
            if enc.scale is None:
                raise ValueError(f"shard {name} {what}: {m.dtype} states need their scale")
            scale = _numpy(enc.scale, f"{what} scale", np.float32, 1, exact=True)
            if len(scale) != t:
                raise ValueError(f"shard {name} {what} has {len(scale)} scales for {t} tokens")
        bad = nonfinite_rows(data, scale, m.dtype)
        if len(bad):
            seq = int(np.searchsorted(offsets, bad[0], side="right")) - 1
            raise NonFiniteStatesError(
                f"Hidden states of sample {sample_ids[seq]} ({what}, token "
                f"{bad[0] - offsets[seq]}) hold NaN or Inf; nothing of shard {name} was written; check that "
                f"sample and the target's dtype.", sample_id=sample_ids[seq])
        return data, scale


def _numpy(x: Any, what: str, dtype: Any, ndim: int, exact: bool = False) -> np.ndarray:
    """A C-contiguous numpy view (or cast copy) of an array or CPU tensor."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.ndim != ndim:
        raise ValueError(f"{what} must have {ndim} dimension(s), got shape {x.shape}")
    if exact and x.dtype != np.dtype(dtype):
        raise ValueError(f"{what} must be {np.dtype(dtype)}, got {x.dtype}")
    if not exact and x.dtype.kind not in "biu":
        raise ValueError(f"{what} must hold integers, got {x.dtype}")
    return np.ascontiguousarray(x, dtype=dtype)


def _check_sequences(name, t, loss_mask, offsets, sample_ids) -> None:
    """The token arrays and sequence boundaries of a payload agree with each other."""
    if t == 0:
        raise ValueError(f"shard {name} has no tokens")
    if len(loss_mask) != t:
        raise ValueError(f"shard {name}: loss_mask has {len(loss_mask)} entries for {t} tokens")
    if loss_mask.max() > 1:
        raise ValueError(f"shard {name}: loss_mask must hold 0/1")
    n = len(sample_ids)
    if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != t or (np.diff(offsets) <= 0).any():
        raise ValueError(f"shard {name}: offsets must rise strictly from 0 to {t} with one entry per "
                         f"sample plus one ({n} samples, got {len(offsets)} offsets)")
