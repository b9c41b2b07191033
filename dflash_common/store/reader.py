"""Reading a store: `Store.open`, the published shards, and chosen layers read straight into
caller-provided buffers (the package docstring and docs/store-format.md give the layout)."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_common.store.chunks import ArrayFile, ChunkError
from dflash_common.store.contents import root_metadata_problem
from dflash_common.store.format import (
    BUFFER_ALIGN, FINAL_ARRAY, FINAL_SCALE_ARRAY, SHARDS_DIR, BufferSpec, ShardInfo, StoreCorruptError, StoreError, StoreManifest,
    StoreMismatchError, check_compatible, check_offsets, layer_array, read_json, read_root_attributes, scale_array,
    short_json,
)
from dflash_common.store.quant import decode_states, has_scale, row_size, storage_numpy_dtype


@dataclasses.dataclass
class ShardData:
    """A shard read into memory: stored encodings, not yet decoded (decode where they are used)."""

    name: str
    dtype: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    offsets: np.ndarray  # int64 [N+1]
    sample_ids: list[str]
    layers: dict[int, np.ndarray]  # layer id -> stored rows [T, row]: uint16 (bf16) | uint8
    scales: dict[int, np.ndarray]  # layer id -> float32 [T] (scaled dtypes only)
    final: np.ndarray | None = None  # the final normed state's rows [T, row], when read
    final_scale: np.ndarray | None = None  # float32 [T] (scaled dtypes only)

    def states(self, layer_id: int | None, *, device: torch.device | str | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Decoded states [T, H] of one layer (None: the final normed state), on `device` (moved
        before decoding: fewer bytes)."""
        if layer_id is None:
            data, scale = torch.from_numpy(self.final), self.final_scale
        else:
            data, scale = torch.from_numpy(self.layers[layer_id]), self.scales.get(layer_id)
        scale_t = None if scale is None else torch.from_numpy(scale)
        if device is not None:
            data = data.to(device, non_blocking=True)
            scale_t = None if scale_t is None else scale_t.to(device, non_blocking=True)
        return decode_states(data, scale_t, self.dtype, out_dtype=out_dtype)


def published_shard_names(path: str | Path) -> list[str]:
    """The shards published in the store at `path`, sorted, read from its shards directory alone (no
    root metadata needed: a store whose root zarr.json is gone still lists them)."""
    try:
        with os.scandir(Path(path) / SHARDS_DIR) as entries:
            return sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())
    except FileNotFoundError:
        return []


class Store:
    """A store opened for reading. Thread-safe: several threads may read shards at once."""

    def __init__(self, path: Path, manifest: StoreManifest, summary: dict[str, Any] | None,
                 read_threads: int):
        self.path = path
        self.manifest = manifest
        self.summary = summary
        self.read_threads = read_threads
        self._shards: list[ShardInfo] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | Path, *, read_threads: int = 4) -> Store:
        """Open a store; refuses anything but a dflash store of a format version this code reads,
        and one whose root zarr.json no longer describes its shards (the sentence blames the root).
        `read_threads` decode chunks in parallel (reads and crc32c overlap; see docs/benchmarks.md)."""
        path = Path(path)
        if not path.exists():
            raise StoreError(f"store {path} does not exist; check the path, or run dflash-precompute to write it.")
        if not (path / "zarr.json").is_file():
            raise StoreError(f"{path} is not a dflash store (no zarr.json); pass the directory "
                             f"dflash-precompute wrote.")
        attrs = read_root_attributes(path)
        manifest = StoreManifest.from_json(attrs, where=f"store {path}")
        store = cls(path, manifest, attrs.get("summary"), max(1, read_threads))
        problem = root_metadata_problem(store)
        if problem:
            raise StoreError(problem)
        return store

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- listing --------------------------------------------------------------------------------

    def shard_names(self) -> list[str]:
        """Published shard names, sorted; hidden names (never published) are skipped."""
        return published_shard_names(self.path)

    @property
    def shards(self) -> list[ShardInfo]:
        """Every published shard with its token and sequence counts (one small JSON read per shard;
        cached: `refresh()` lists again)."""
        if self._shards is None:
            self._shards = [self._info(name, self._shard_attrs(name)) for name in self.shard_names()]
        return self._shards

    def refresh(self) -> None:
        self._shards = None

    def shard(self, name: str) -> ShardInfo:
        return self._info(name, self._shard_attrs(name))

    def _shard_attrs(self, name: str) -> dict[str, Any]:
        try:
            attrs = read_json(self.path / SHARDS_DIR / name / "zarr.json")["attributes"]
            t, n, ids = int(attrs["num_tokens"]), int(attrs["num_sequences"]), attrs["sample_ids"]
            if not (0 < n <= t and isinstance(ids, list) and len(ids) == n):  # sizes buffers: check first
                raise ValueError(f"{n} sequences, {t} tokens and {len(ids)} sample ids do not fit together")
        except FileNotFoundError:
            if not (self.path / SHARDS_DIR / name).is_dir():
                raise StoreError(f"store {self.path} has no shard {name!r}; list store.shards.") from None
            raise self._corrupt(name, "its zarr.json is missing") from None
        except (KeyError, TypeError, ValueError) as e:
            raise self._corrupt(name, f"its zarr.json is unreadable ({e!r})") from e
        return attrs

    @staticmethod
    def _info(name: str, attrs: Mapping[str, Any]) -> ShardInfo:
        return ShardInfo(name, int(attrs["num_tokens"]), int(attrs["num_sequences"]))

    def _corrupt(self, name: str, why: str) -> StoreCorruptError:
        return StoreCorruptError(
            f"Shard {name} of store {self.path} is corrupt: {why}; delete {self.path / SHARDS_DIR / name} "
            f"and rerun dflash-precompute to rewrite it.", shard=name)

    # -- reading --------------------------------------------------------------------------------

    def buffer_specs(self, name_or_info: str | ShardInfo, layer_ids: Sequence[int] | None = None,
                     final: bool | None = None) -> dict[str, BufferSpec]:
        """The arrays `read_shard` fills, by array name, for the chosen layers and, with `final`, the
        final normed state (None: with layer_ids None, whatever the store holds) (no array is read)."""
        info = name_or_info if isinstance(name_or_info, ShardInfo) else self.shard(name_or_info)
        t, n, m = info.num_tokens, info.num_sequences, self.manifest
        specs = {"input_ids": BufferSpec((t,), np.dtype(np.int32)),
                 "loss_mask": BufferSpec((t,), np.dtype(np.uint8)),
                 "offsets": BufferSpec((n + 1,), np.dtype(np.int64))}
        rows = BufferSpec((t, row_size(m.dtype, m.hidden_size)), storage_numpy_dtype(m.dtype))
        scales = BufferSpec((t,), np.dtype(np.float32))
        for layer_id in self._layer_ids(layer_ids):
            specs[layer_array(layer_id)] = rows
            if has_scale(m.dtype):
                specs[scale_array(layer_id)] = scales
        if self._wants_final(layer_ids, final):
            specs[FINAL_ARRAY] = rows
            if has_scale(m.dtype):
                specs[FINAL_SCALE_ARRAY] = scales
        return specs

    def _wants_final(self, layer_ids: Sequence[int] | None, final: bool | None) -> bool:
        if final is None:
            return layer_ids is None and self.manifest.final_state
        if final and not self.manifest.final_state:
            raise StoreMismatchError(f"store {self.path} holds no final states; precompute it with "
                                     f"--store.final_state=true.")
        return final

    def shard_nbytes(self, name_or_info: str | ShardInfo, layer_ids: Sequence[int] | None = None,
                     final: bool | None = None) -> int:
        """Bytes of one buffer that `carve_buffers` splits into the arrays of a shard read."""
        return buffers_nbytes(self.buffer_specs(name_or_info, layer_ids, final))

    def _layer_ids(self, layer_ids: Sequence[int] | None) -> list[int]:
        if layer_ids is None:
            return list(self.manifest.layer_ids)
        missing = [i for i in layer_ids if i not in self.manifest.layer_ids]
        if missing:
            raise StoreMismatchError(f"store {self.path} holds layers {list(self.manifest.layer_ids)}, "
                                     f"not {missing}; read layers the store has.")
        return list(layer_ids)

    def read_shard(self, name: str, layer_ids: Sequence[int] | None = None,
                   out: Mapping[str, np.ndarray] | None = None, final: bool | None = None) -> ShardData:
        """Read one shard's token arrays, the chosen layers (default: all) and, with `final`, the
        final normed state (default: when all layers are read and the store has it) into `out` (arrays
        shaped as `buffer_specs` says, e.g. from `carve_buffers` over pinned memory) or new arrays.
        Each chunk lands in its buffer directly; a checksum mismatch raises StoreCorruptError."""
        attrs = self._shard_attrs(name)
        specs = self.buffer_specs(self._info(name, attrs), layer_ids, final)
        if out is None:
            bufs = {k: np.empty(s.shape, s.dtype) for k, s in specs.items()}
        else:
            bufs = _check_out(specs, out)
        try:
            self._read_arrays(self.path / SHARDS_DIR / name, specs, bufs)
            check_offsets(bufs["offsets"], specs["input_ids"].shape[0])
        except (ChunkError, OSError, ValueError, KeyError) as e:
            raise self._corrupt(name, str(e)) from e
        ids = self._layer_ids(layer_ids)
        return ShardData(
            name=name, dtype=self.manifest.dtype, input_ids=bufs["input_ids"], loss_mask=bufs["loss_mask"],
            offsets=bufs["offsets"], sample_ids=list(attrs["sample_ids"]),
            layers={i: bufs[layer_array(i)] for i in ids},
            scales={i: bufs[scale_array(i)] for i in ids if scale_array(i) in bufs},
            final=bufs.get(FINAL_ARRAY), final_scale=bufs.get(FINAL_SCALE_ARRAY))

    def _read_arrays(self, shard_dir: Path, specs: Mapping[str, BufferSpec],
                     bufs: Mapping[str, np.ndarray]) -> None:
        opened: list[tuple[str, ArrayFile]] = []
        try:
            for array_name, spec in specs.items():
                opened.append((array_name, ArrayFile.open_expecting(shard_dir / array_name, spec.shape, spec.dtype)))
            pool = self._executor()
            futures = [pool.submit(f.read_chunks, run, bufs[a])
                       for a, f in opened if len(f.layout.shape) == 2 for run in f.runs()]
            try:  # the small 1-D arrays are read here, while the pool reads the states
                for a, f in opened:
                    if len(f.layout.shape) == 1:
                        f.read_chunks(range(f.layout.n_chunks), bufs[a])
            finally:
                wait(futures)  # never return (or raise) while a thread still writes into `bufs`
            for future in futures:
                future.result()  # re-raises a chunk error
        finally:
            for _, f in opened:
                f.close()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="dflash-store-read")
            return self._pool

    # -- checking -------------------------------------------------------------------------------

    def check_compatible(self, *, layer_ids: Sequence[int], hidden_size: int,
                         tokenizer_sha256: str | None = None) -> None:
        check_compatible(self.manifest, layer_ids=layer_ids, hidden_size=hidden_size,
                         tokenizer_sha256=tokenizer_sha256, where=f"store {self.path}")



def _aligned(nbytes: int) -> int:
    return -(-nbytes // BUFFER_ALIGN) * BUFFER_ALIGN


def buffers_nbytes(specs: Mapping[str, BufferSpec]) -> int:
    """Size of one flat buffer holding all `specs` arrays, each starting BUFFER_ALIGN-aligned."""
    return sum(_aligned(s.nbytes) for s in specs.values())


def carve_buffers(specs: Mapping[str, BufferSpec],
                  buffer: np.ndarray | torch.Tensor) -> dict[str, np.ndarray]:
    """Split a flat uint8 buffer (e.g. a slot of a pinned torch tensor) into views for `read_shard`'s
    `out`; no copy, so the read lands in the caller's memory."""
    flat = buffer.numpy() if isinstance(buffer, torch.Tensor) else buffer
    if flat.dtype != np.uint8 or flat.ndim != 1 or flat.nbytes < buffers_nbytes(specs):
        raise ValueError(f"buffer must be 1-D uint8 of at least {buffers_nbytes(specs)} bytes, got "
                         f"{flat.dtype} {flat.shape}")
    views, offset = {}, 0
    for name, s in specs.items():
        views[name] = flat[offset: offset + s.nbytes].view(s.dtype).reshape(s.shape)
        offset += _aligned(s.nbytes)
    return views


def _check_out(specs: Mapping[str, BufferSpec], out: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    bufs = {}
    for name, spec in specs.items():
        buf = out.get(name)
        if buf is None:
            raise ValueError(f"out has no buffer for array {name!r} (see Store.buffer_specs)")
        if isinstance(buf, torch.Tensor):
            buf = buf.numpy()
        if buf.shape != spec.shape or buf.dtype != spec.dtype or not buf.flags.c_contiguous \
                or not buf.flags.writeable:
            raise ValueError(f"out[{name!r}] must be a writeable C-contiguous {spec.dtype} array of shape "
                             f"{spec.shape}, got {buf.dtype} {buf.shape}")
        bufs[name] = buf
    return bufs


_SAME_ACROSS_STORES = ("hidden_size", "tokenizer.sha256", "chat_template_sha256", "target.config_sha256",
                       "target.weights_sha256")


def open_stores(paths: Sequence[str | Path], *, read_threads: int = 4) -> list[Store]:
    """Open several stores for one training run; they must share target, tokenizer and hidden size
    (layer sets, dtypes and codecs may differ: check each with `Store.check_compatible`)."""
    stores = [Store.open(p, read_threads=read_threads) for p in paths]
    if not stores:
        raise StoreError("no store given; pass at least one store directory.")
    first = stores[0].manifest.to_json()
    for other in stores[1:]:
        theirs = other.manifest.to_json()
        for key in _SAME_ACROSS_STORES:
            a, b = _dig(first, key), _dig(theirs, key)
            if a != b:
                raise StoreMismatchError(f"stores {stores[0].path} and {other.path} differ in {key} "
                                         f"({short_json(a)} vs {short_json(b)}); train from stores of one "
                                         f"target and tokenizer.")
    return stores


def _dig(tree: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, Mapping) else None
    return tree
