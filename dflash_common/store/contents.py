"""What a store says it holds, checked against what it holds.

The root zarr.json describes the store twice: the manifest (dtype, layers, hidden size: what every
shard is) and, once dflash-precompute has finished, the summary (work units, tokens, and the name of
every shard). They part from the shards in two ways, and each has its own fix:

- a shard the summary lists is gone (deleted, lost in a copy): `store_contents` names it, and the
  command that wrote the store refills it (it resumes and writes only what is missing);
- the manifest describes none of the shards (the root zarr.json was edited): `root_metadata_problem`
  blames the root and says how to restore it; deleting shards that are fine would lose data.

A store without a summary is still being written, or its writer stopped: it is incomplete, and no
shard can be called missing yet. Summaries written before the shard list was recorded name a missing
shard by its work unit (`u00000004-*`), from their unit count and `empty_units`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from dflash_common.store.format import (
    SHARDS_DIR,
    BufferSpec,
    ShardInfo,
    StoreManifest,
    layer_array,
    read_json,
    shard_glob,
    shard_unit,
    short_json,
)

_SHOWN = 5  # missing shards named in a sentence; the rest are counted


class StoreView(Protocol):
    """What this module reads of a `reader.Store` (which calls it from `open`: no import back)."""

    path: Path
    manifest: StoreManifest
    summary: dict[str, Any] | None

    def shard_names(self) -> list[str]: ...

    def buffer_specs(
        self,
        name_or_info: str | ShardInfo,
        layer_ids: Any = None,
        final: bool | None = None,
    ) -> dict[str, BufferSpec]: ...


@dataclasses.dataclass(frozen=True)
class StoreContents:
    """The published shards against the store's summary."""

    shards: int  # published
    summarised: bool  # dflash-precompute wrote its summary (a store without one is incomplete)
    expected_shards: int | None  # the summary's count (None: it does not say)
    expected_tokens: int | None
    missing: tuple[str, ...]  # shard names, or `u<unit>-*` from a summary without the shard list

    @property
    def status(self) -> str:
        if not self.summarised:
            return "incomplete"
        return "missing shards" if self.missing else "complete"


def store_contents(store: StoreView) -> StoreContents:
    """Compare the published shard names with the summary (no shard is read: a damaged one is
    verify's and the reader's to name)."""
    present = set(store.shard_names())
    summary = store.summary
    if not isinstance(summary, Mapping):
        return StoreContents(len(present), False, None, None, ())
    listed = summary.get("shards")
    if isinstance(listed, list):
        expected, missing = len(listed), sorted(set(listed) - present)
    elif isinstance(summary.get("units"), int):  # a summary from before the shard list
        empty = set(summary.get("empty_units") or ())
        units = [u for u in range(summary["units"]) if u not in empty]
        have = {shard_unit(name) for name in present}
        expected, missing = len(units), [shard_glob(u) for u in units if u not in have]
    else:
        expected, missing = None, []
    total = summary.get("tokens")
    return StoreContents(
        len(present),
        True,
        expected,
        total if isinstance(total, int) else None,
        tuple(missing),
    )


def precompute_record(store_path: str | Path) -> Path:
    """The resolved config dflash-precompute writes beside its store (loadable with --config)."""
    path = Path(store_path)
    return path.parent / f"{path.name}.precompute.toml"


def refill_advice(store_path: str | Path) -> str:
    """How to write a store's missing shards: its own command again."""
    record = precompute_record(store_path)
    how = f" (`dflash-precompute --config {record}`)" if record.is_file() else ""
    return (
        f"rerun dflash-precompute with the command that wrote the store{how}: it resumes and "
        f"writes only the missing shards"
    )


def missing_sentence(store_path: str | Path, contents: StoreContents) -> str:
    """`store X lacks N of the M shards its summary lists (names); rerun ...` (no final period)."""
    names = list(contents.missing)
    shown = ", ".join(names[:_SHOWN]) + (
        f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    )
    return (
        f"store {store_path} lacks {len(names)} of the {contents.expected_shards} shards its "
        f"summary lists ({shown}); {refill_advice(store_path)}"
    )


def incomplete_sentence(store_path: str | Path) -> str:
    return (
        f"store {store_path} is incomplete: it has no summary yet, so dflash-precompute is still "
        f"writing it or stopped before the end; rerun that command to finish it (it resumes)"
    )


def contents_info(store: StoreView) -> dict[str, Any]:
    """The contents fields of `dflash-store info --json`."""
    c = store_contents(store)
    return {
        "status": c.status,
        "expected_shards": c.expected_shards,
        "expected_tokens": c.expected_tokens,
        "missing_shards": list(c.missing),
    }


def disk_bytes(store_path: str | Path) -> int:
    """Bytes of the published store: the root zarr.json and every file under shards/ (staging and
    other hidden names excluded): the one size on disk precompute and `dflash-store info` print."""
    root = Path(store_path)
    total = (root / "zarr.json").stat().st_size
    for dirpath, dirnames, filenames in os.walk(root / SHARDS_DIR):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        total += sum(
            os.stat(os.path.join(dirpath, f)).st_size for f in filenames if not f.startswith(".")
        )
    return total


# ------------------------------------------------------------------ a root that describes no shard

# What a shard records about itself that the manifest also says; "row" is the width of its state
# arrays, which the manifest's hidden_size (with its dtype) decides.
_SHARD_KEYS = ("dtype", "layer_ids", "final_state", "row")


def _shard_record(store: StoreView, name: str) -> dict[str, Any] | None:
    """Shard `name`'s own record of the manifest keys (its group attributes, and its first state
    array's zarr.json); None when they cannot be read (a damaged shard: verify names it)."""
    shard = store.path / SHARDS_DIR / name
    try:
        attrs = read_json(shard / "zarr.json")["attributes"]
        layer_ids = sorted(int(i) for i in attrs["layer_ids"])
        shape = read_json(shard / layer_array(layer_ids[0]) / "zarr.json")["shape"]
        return {
            "dtype": attrs["dtype"],
            "layer_ids": layer_ids,
            "final_state": bool(attrs.get("final_state")),
            "row": int(shape[1]),
        }
    except (OSError, KeyError, TypeError, ValueError, IndexError):
        return None


def _root_record(store: StoreView) -> dict[str, Any]:
    m = store.manifest
    first = m.layer_ids[0]
    row = store.buffer_specs(ShardInfo("", 1, 1), [first], final=False)[layer_array(first)].shape[1]
    return {
        "dtype": m.dtype,
        "layer_ids": list(m.layer_ids),
        "final_state": m.final_state,
        "row": row,
    }


def root_metadata_problem(store: StoreView) -> str | None:
    """One sentence when the root manifest disagrees, in one key, with every readable shard while
    they all agree among themselves: the root zarr.json was edited, and restoring it is the fix.
    None when a shard agrees with the root (a disagreeing shard is then that shard's problem), or
    none is readable. Reads one shard's metadata for a sound store."""
    root = _root_record(store)
    records = []
    for name in store.shard_names():
        record = _shard_record(store, name)
        if record is None:
            continue
        if record == root:
            return None
        records.append(record)
    for key in _SHARD_KEYS:
        theirs = {short_json(r[key]) for r in records}
        if len(theirs) == 1 and records[0][key] != root[key]:
            return _root_changed(store, key, root[key], records[0][key], len(records))
    return None


def _root_changed(store: StoreView, key: str, ours: Any, theirs: Any, n: int) -> str:
    path, root_file = store.path, store.path / "zarr.json"
    keep = "the shards are intact: do not delete them"
    if key == "row":  # the hidden size: the shards hold a width, the fix is the target's size
        m = store.manifest
        size = m.target.get("hidden_size")
        fix = (
            f'set "hidden_size" back to {size}'
            if isinstance(size, int) and size != m.hidden_size
            else 'set "hidden_size" back to the hidden size of the store\'s target'
        )
        return (
            f"the root zarr.json of store {path} was changed: its hidden_size = {m.hidden_size} "
            f"does not fit the states of any of its {n} readable shards ({theirs} values wide); "
            f"{fix} in {root_file} ({keep})."
        )
    # a store without final states has no such key (the manifest leaves it out when false)
    fix = (
        f'remove "{key}" from'
        if key == "final_state" and not theirs
        else f'set "{key}" back to {short_json(theirs)} in'
    )
    return (
        f"the root zarr.json of store {path} was changed: it says {key} = {short_json(ours)}, "
        f"but all {n} readable shards were written with {key} = {short_json(theirs)}; "
        f"{fix} {root_file} ({keep})."
    )
