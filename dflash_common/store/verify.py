"""`verify` and `info` of a store: every checksum, every shard's consistency, and the totals.

verify reads every byte of every shard: the index and each chunk of every array are checked against
their crc32c; the small arrays (token ids, loss mask, offsets, per-token scales) are decoded and checked
for consistency (offsets rise from 0 to T, masks are 0/1, scales finite); the shard's layer set,
dtype and array shapes must match the manifest. State chunks are not decompressed: their crc32c
covers the stored bytes, and NaN/Inf were refused when they were written.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash_common.cli import progress_bar
from dflash_common.store.chunks import ArrayFile, ChunkError
from dflash_common.store.contents import contents_info, disk_bytes
from dflash_common.store.format import (
    FINAL_SCALE_ARRAY, FORMAT_NAME, SHARDS_DIR, STAGING_DIR, StoreCorruptError, check_offsets, layer_array, scale_array,
)

if TYPE_CHECKING:
    from dflash_common.store.reader import Store


@dataclasses.dataclass
class VerifyReport:
    shards_checked: int
    bad: dict[str, str]  # shard name -> what is wrong with it
    staging: list[str]  # unpublished leftovers in .staging/ (invisible to readers; not an error)

    @property
    def ok(self) -> bool:
        return not self.bad


def verify_store(store: Store, *, progress: bool = True) -> VerifyReport:
    """Check every shard of `store`, `store.read_threads` shards at a time; a bad shard is reported,
    never raised, so all are checked."""
    names = store.shard_names()
    bad = {}
    with ThreadPoolExecutor(store.read_threads, thread_name_prefix="dflash-store-verify") as pool:
        results = pool.map(lambda name: _shard_problem(store, name), names)
        for name, problem in progress_bar(zip(names, results), enabled=progress, total=len(names), desc="verify",
                                          unit="shard"):
            if problem:
                bad[name] = problem
    staging = sorted(os.listdir(store.path / STAGING_DIR)) if (store.path / STAGING_DIR).is_dir() else []
    return VerifyReport(len(names), bad, staging)


def _shard_problem(store: Store, name: str) -> str | None:
    """What is wrong with one shard, as the one-sentence message of a StoreCorruptError; None if fine."""
    try:
        _verify_shard(store, name)
    except StoreCorruptError as e:
        return str(e)
    except (ChunkError, OSError, ValueError, KeyError, TypeError) as e:
        return str(store._corrupt(name, str(e) or repr(e)))
    return None


def _verify_shard(store: Store, name: str) -> None:
    attrs = store._shard_attrs(name)
    m = store.manifest
    if attrs.get("format") != FORMAT_NAME + "/shard" or attrs.get("format_version") != m.format_version:
        raise ValueError(f"its format is {attrs.get('format')!r} version {attrs.get('format_version')!r}")
    if list(attrs.get("layer_ids", [])) != list(m.layer_ids) or attrs.get("dtype") != m.dtype:
        raise ValueError(f"it holds layers {attrs.get('layer_ids')} as {attrs.get('dtype')}, the manifest "
                         f"says {list(m.layer_ids)} as {m.dtype}")
    if bool(attrs.get("final_state", False)) != m.final_state:
        raise ValueError(f"its final_state is {bool(attrs.get('final_state', False))}, the manifest says "
                         f"{m.final_state}")
    if len(attrs["sample_ids"]) != attrs["num_sequences"]:
        raise ValueError(f"it lists {len(attrs['sample_ids'])} sample ids for {attrs['num_sequences']} "
                         f"sequences")
    specs = store.buffer_specs(name)
    shard_dir = store.path / SHARDS_DIR / name
    small = {}
    for array_name, spec in specs.items():
        with ArrayFile.open_expecting(shard_dir / array_name, spec.shape, spec.dtype) as f:
            if len(spec.shape) == 2:  # states: checksums only
                for i in range(f.layout.n_chunks):
                    f.check_chunk(i)
            else:
                small[array_name] = np.empty(spec.shape, spec.dtype)
                f.read_chunks(range(f.layout.n_chunks), small[array_name])
    _check_small_arrays(small, attrs["num_tokens"], m.layer_ids)


def _check_small_arrays(small: dict[str, np.ndarray], num_tokens: int, layer_ids) -> None:
    check_offsets(small["offsets"], num_tokens)
    if small["loss_mask"].max() > 1:
        raise ValueError("its loss_mask holds values other than 0 and 1")
    for layer_id in layer_ids:
        scale = small.get(scale_array(layer_id))
        if scale is not None and not (np.isfinite(scale).all() and (scale >= 0).all()):
            raise ValueError(f"the scales of {layer_array(layer_id)} are not all finite and >= 0")
    scale = small.get(FINAL_SCALE_ARRAY)
    if scale is not None and not (np.isfinite(scale).all() and (scale >= 0).all()):
        raise ValueError("the scales of the final state are not all finite and >= 0")


def store_info(store: Store) -> dict[str, Any]:
    """Totals from shard metadata and file sizes (no array is read), and what the summary says the
    store should hold."""
    m = store.manifest
    shards = store.shards
    tokens = sum(s.num_tokens for s in shards)
    sequences = sum(s.num_sequences for s in shards)
    decoded = sum(spec.nbytes for s in shards for spec in store.buffer_specs(s).values())
    disk = disk_bytes(store.path)
    # every array but the offsets holds one row per token: states (and fp8 scales), token ids, loss mask
    per_token = [sum(v.nbytes for k, v in store.buffer_specs(s).items() if k != "offsets") // s.num_tokens
                 for s in shards[:1] if s.num_tokens]
    return {
        "path": str(store.path), "format_version": m.format_version, "target": m.target.get("name"),
        "layer_ids": list(m.layer_ids), "final_state": m.final_state, "hidden_size": m.hidden_size, "dtype": m.dtype, "codec": m.codec,
        "chunk_tokens": m.chunk_tokens, "shards": len(shards), "sequences": sequences, "tokens": tokens,
        # decoded: the arrays a read returns (= the plan's projection); on disk: every published file
        "decoded_bytes": decoded, "array_bytes_per_token": per_token[0] if per_token else None,
        "bytes_on_disk": disk, "bytes_per_token": disk / tokens if tokens else None,
        "compression_ratio": decoded / disk if disk else None,  # the text output shows it only for a codec
        "summary": store.summary,
        **contents_info(store),  # against the summary: complete, incomplete, or what is missing
    }
