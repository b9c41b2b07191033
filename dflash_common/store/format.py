"""The store's format: names, version, manifest, and what writers and readers exchange.

docs/store-format.md is the written spec; dflash_common/store/reader.py is the public entry point.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dflash_common.errors import UserError
from dflash_common.store.chunks import check_codec
from dflash_common.store.quant import EncodedStates, check_hidden_size

FORMAT_NAME = "dflash-hidden-states"
# A store carries the lowest version that reads it whole, so a reader that predates a feature refuses
# exactly the stores that use it: 1 = bf16 / fp8_e4m3 states, 2 = q4_hadamard states (a version-1
# reader would misread their 9H/16-byte rows). Readers refuse versions they do not know.
FORMAT_VERSION = 2  # the newest version this code writes and reads
READ_VERSIONS = (1, 2)
SHARDS_DIR = "shards"
STAGING_DIR = ".staging"
STALE_STAGING_S = 24 * 3600  # a shard write takes minutes; a day-old staging dir is a dead writer's
BUFFER_ALIGN = 4096  # carved arrays start at page offsets of their buffer (DMA- and O_DIRECT-friendly)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class StoreError(UserError):
    """A store problem a user can act on; the message is one sentence naming the store and the fix."""


class StoreCorruptError(StoreError):
    """A shard's bytes or structure do not check out; `shard` names it."""

    def __init__(self, message: str, shard: str):
        super().__init__(message)
        self.shard = shard


class StoreMismatchError(StoreError):
    """A store does not match what the caller needs (manifest, layers, hidden size, tokenizer)."""


class NonFiniteStatesError(StoreError):
    """States of a sample hold NaN/Inf; nothing of the shard was written. `sample_id` names it."""

    def __init__(self, message: str, sample_id: str):
        super().__init__(message)
        self.sample_id = sample_id


@dataclasses.dataclass(frozen=True)
class StoreManifest:
    """What a store holds and how it was made: the root attributes of the zarr group.

    Nothing here may depend on the number of ranks or on the clock: every writer of a store passes
    an identical manifest, and the finished store is the same whatever the world size."""

    target: dict[str, Any]  # fingerprint.target_fingerprint(...)
    tokenizer: dict[str, Any]  # fingerprint.tokenizer_fingerprint(...)
    chat_template_sha256: str | None  # fingerprint.chat_template_sha256(...)
    layer_ids: tuple[int, ...]  # outputs of these decoder layers (HF hidden_states[i + 1])
    hidden_size: int
    dtype: str = "bf16"  # storage dtype: bf16 | fp8_e4m3 | q4_hadamard (dflash_common/store/quant.py)
    codec: str = "none"  # none | zstd | blosc-lz4-bitshuffle (dflash_common/store/chunks.py)
    chunk_tokens: int = 1024  # max rows per inner chunk: 8 MiB at H=4096 bf16 (benchmarks/store_io.py)
    dataset: dict[str, Any] = dataclasses.field(default_factory=dict)  # fingerprint.dataset_fingerprint
    precompute: dict[str, Any] = dataclasses.field(default_factory=dict)  # the precompute config
    # fingerprint.head_fingerprint: the target's embedding/lm_head and drafter-copied config fields;
    # {} in stores written before it was recorded (the trainer then compares `target` as a whole)
    target_head: dict[str, Any] = dataclasses.field(default_factory=dict)
    format_version: int | None = None  # None: the version the dtype needs (`format_version_for`)
    # shards also hold the target's final normed hidden state (the lm_head's input), array "final";
    # written only when true, so stores without it keep the exact manifest they were made with
    final_state: bool = False

    def __post_init__(self) -> None:
        ids = tuple(int(i) for i in self.layer_ids)
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"layer_ids {list(self.layer_ids)} must be distinct non-negative ids")
        object.__setattr__(self, "layer_ids", tuple(sorted(ids)))  # a set of layers: one canonical order
        if self.hidden_size < 1 or self.chunk_tokens < 1:
            raise ValueError("hidden_size and chunk_tokens must be positive")
        check_hidden_size(self.dtype, self.hidden_size)
        check_codec(self.codec)
        need = format_version_for(self.dtype)
        if self.format_version is None:
            object.__setattr__(self, "format_version", need)
        elif self.format_version < need:
            raise ValueError(f"format version {self.format_version} has no {self.dtype} states")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        if not self.final_state:
            del d["final_state"]  # absent means false: older stores compare equal, byte for byte
        if not d["target_head"]:  # a store of a dflash before it was recorded: its manifest as it was
            del d["target_head"]
        return json.loads(json.dumps({"format": FORMAT_NAME, **d}))  # plain JSON types, as stored

    @classmethod
    def from_json(cls, attrs: Mapping[str, Any], where: str = "store") -> StoreManifest:
        if attrs.get("format") != FORMAT_NAME:
            raise StoreError(f"{where} is not a dflash hidden-state store (its zarr.json has no "
                             f"'format: {FORMAT_NAME}'); pass the directory dflash-precompute wrote.")
        version = attrs.get("format_version")
        if version not in READ_VERSIONS:
            raise StoreError(f"{where} has store format version {version!r}, but this dflash reads "
                             f"versions {', '.join(map(str, READ_VERSIONS))}; use the dflash version "
                             f"that wrote it.")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in attrs.items() if k in names})
        except (TypeError, ValueError) as e:
            raise StoreError(f"{where} has a malformed manifest ({e}); the store is damaged.") from e


def format_version_for(dtype: str) -> int:
    """The lowest store format version that holds states of `dtype` (see FORMAT_VERSION)."""
    return 2 if dtype == "q4_hadamard" else 1


@dataclasses.dataclass(frozen=True)
class ShardPayload:
    """One work unit's shard, as the writer takes it (numpy arrays or CPU tensors).

    input_ids int32 [T], loss_mask bool/uint8 [T], offsets int64 [N+1] (sequence i is tokens
    offsets[i]:offsets[i+1]), sample_ids N strings such as 'data.jsonl:17', and one EncodedStates
    [T, row] per captured layer id (from quant.encode_states), plus the final state when the store
    holds final states."""

    input_ids: Any
    loss_mask: Any
    offsets: Any
    sample_ids: Sequence[str]
    layers: Mapping[int, EncodedStates]
    final: EncodedStates | None = None  # the final normed state [T, row]; exactly when the manifest says so


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    name: str
    num_tokens: int
    num_sequences: int


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """Shape and dtype of one array a shard read fills."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def shard_name(unit_index: int, digest: str) -> str:
    """Name of a work unit's shard: its index (for ordering and humans) and a digest of its content
    (sample ids, tokens), so a rerun of the same unit writes the same name and can skip it."""
    if unit_index < 0 or not re.fullmatch(r"[0-9a-fA-F]{8,}", digest):
        raise ValueError(f"unit index {unit_index} must be >= 0 and digest {digest!r} hex (8+ digits)")
    return f"u{unit_index:08d}-{digest[:16].lower()}"


def shard_unit(name: str) -> int | None:
    """The work unit of a shard named by shard_name, or None for another name."""
    m = re.fullmatch(r"u(\d{8,})-[0-9a-f]{8,}", name)
    return int(m.group(1)) if m else None


def shard_glob(unit: int) -> str:
    """The names shard_name gives work unit `unit`, as a shell pattern (`u00000004-*`)."""
    return f"u{unit:08d}-*"


def check_shard_name(name: str) -> None:
    if not _NAME_RE.match(name) or name == "zarr.json":
        raise ValueError(f"shard name {name!r} must be 1-128 of [A-Za-z0-9_.-], not starting with '.' "
                         f"or '-' (hidden names are invisible to readers)")


def layer_array(layer_id: int) -> str:
    return f"layer_{layer_id}"


def scale_array(layer_id: int) -> str:
    return f"layer_{layer_id}_scale"


FINAL_ARRAY = "final"  # the target's final normed hidden state (manifest final_state)
FINAL_SCALE_ARRAY = "final_scale"


def group_metadata(attributes: Mapping[str, Any]) -> bytes:
    """A zarr v3 group's zarr.json; sorted keys so every writer produces the same bytes."""
    meta = {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes)}
    return (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()


def short_json(value: Any) -> str:
    """A JSON value for an error message, cut to 80 characters."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_json(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return json.loads(f.read())


def read_root_attributes(path: Path) -> dict[str, Any]:
    """The root group's attributes (manifest + summary); a cut or overwritten root zarr.json is a
    StoreError with the fix, not a JSON traceback."""
    try:
        attrs = read_json(path / "zarr.json").get("attributes", {})
        if not isinstance(attrs, dict):
            raise ValueError("its attributes are not a table")
    except (ValueError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise StoreError(f"store {path} has an unreadable zarr.json ({e}); delete that file and rerun "
                         f"dflash-precompute with the store's config, which rewrites it and keeps the "
                         f"shards.") from e
    return attrs


def check_offsets(offsets: np.ndarray, num_tokens: int) -> None:
    """Sequence boundaries must rise strictly from 0 to T (no empty sequence)."""
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != num_tokens or (np.diff(offsets) <= 0).any():
        raise ValueError(f"its offsets do not rise strictly from 0 to {num_tokens}")


def check_compatible(manifest: StoreManifest, *, layer_ids: Sequence[int], hidden_size: int,
                     tokenizer_sha256: str | None = None, where: str = "the store") -> None:
    """Raise StoreMismatchError (one sentence: what differs, what to do) unless a drafter reading
    `layer_ids` at `hidden_size` with this tokenizer can train from a store of this manifest."""
    m = manifest
    if hidden_size != m.hidden_size:
        raise StoreMismatchError(f"{where} holds states of hidden size {m.hidden_size}, but the drafter "
                                 f"needs {hidden_size}; use a store precomputed from the drafter's target.")
    missing = [i for i in layer_ids if i not in m.layer_ids]
    if missing:
        raise StoreMismatchError(f"{where} holds target layers {list(m.layer_ids)}, but the drafter also "
                                 f"reads {missing}; pick layer ids from {list(m.layer_ids)}, or precompute "
                                 f"a store that captures {sorted(set(layer_ids))}.")
    stored = m.tokenizer.get("sha256")
    if tokenizer_sha256 is not None and tokenizer_sha256 != stored:
        raise StoreMismatchError(f"{where} was precomputed with tokenizer {str(stored)[:12]}, but the "
                                 f"drafter's tokenizer is {tokenizer_sha256[:12]}; train with the tokenizer "
                                 f"of the store's target.")
