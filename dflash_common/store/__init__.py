"""The hidden-state store: one zarr v3 group on disk, one shard per work unit (docs/store-format.md
is the written spec).

    store/
      zarr.json                      root group; attributes = the manifest (+ a `summary`, written last)
      shards/zarr.json               group holding the published shards
      shards/<name>/zarr.json        shard group; attributes: token/sequence counts, sample ids
      shards/<name>/input_ids        int32 [T]
      shards/<name>/loss_mask        uint8 [T]
      shards/<name>/offsets          int64 [N+1]
      shards/<name>/layer_<id>       uint16 [T, H] (bf16 bits), uint8 [T, H] (fp8 e4m3 bits) or
                                     uint8 [T, 9H/16] (q4_hadamard codes and group scales)
      shards/<name>/layer_<id>_scale float32 [T] (fp8_e4m3 and q4_hadamard)
      .staging/                      shards being written (hidden: readers never look here)

Writers (many processes at once, no locks) build a shard under `.staging/`, fsync it and publish it
with one rename to `shards/<name>`; the name comes from the work unit's content, so the first writer
wins and a rerun skips it. Readers list `shards/`, skip hidden names, and read chosen layers straight
into caller-provided buffers (dflash_common/store/chunks.py); every chunk is checked against its crc32c.

One module each: `format` (manifest, names, errors, version checks), `chunks` (data files and their
crc32c), `quant` (the bf16 / fp8_e4m3 / q4_hadamard encodings), `writer` (staging and publishing),
`reader` (`Store`), `contents` (the shards against the summary and the root manifest: missing shards,
a hand-edited root), `verify` (checksums, `dflash-store verify` / `info`) and `cli` (`dflash-store`).
"""

from dflash_common.store.format import (
    BUFFER_ALIGN, FORMAT_NAME, FORMAT_VERSION, SHARDS_DIR, BufferSpec, NonFiniteStatesError, ShardInfo, ShardPayload,
    StoreCorruptError, StoreError, StoreManifest, StoreMismatchError, check_compatible, shard_name, shard_unit,
)
from dflash_common.store.quant import decode_states, encode_states
from dflash_common.store.reader import (
    ShardData, Store, buffers_nbytes, carve_buffers, open_stores, published_shard_names,
)
from dflash_common.store.writer import StoreWriter

__all__ = [
    "BUFFER_ALIGN", "FORMAT_NAME", "FORMAT_VERSION", "SHARDS_DIR", "BufferSpec", "NonFiniteStatesError",
    "ShardData", "ShardInfo", "ShardPayload", "Store", "StoreCorruptError", "StoreError", "StoreManifest",
    "StoreMismatchError", "StoreWriter", "buffers_nbytes", "carve_buffers", "check_compatible", "decode_states",
    "encode_states", "open_stores", "published_shard_names", "shard_name", "shard_unit",
]
