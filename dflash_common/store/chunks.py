"""Array data of the store: zarr v3 `sharding_indexed` files, written and read without extra copies.

Every array of a store shard is a zarr v3 array with *one* shard file (`c/0` for 1-D arrays, `c/0/0`
for [T, H] arrays) holding inner chunks of `chunk_rows` rows, each encoded as
`bytes(little endian) -> [zstd | blosc lz4 bitshuffle] -> crc32c`, followed by the shard index
(n x (offset, nbytes) uint64 little endian, then its own crc32c). That is the layout zarr itself
writes and reads (tests check both directions), so any zarr v3 reader opens the store.

zarr creates the metadata (`zarr.json`); the bytes of the data files are written and read here
because zarr 3.1's sharding path assembles a whole shard in memory on write and decodes into a
full-size temporary on read (measured 0.07-0.4x the raw read speed; docs/store-format.md). Here a
chunk is read straight into the caller's buffer (codec `none`) or decompressed into it from a small
per-thread scratch buffer, in 1 MiB pieces each checked into the chunk's crc32c while in the cache.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import threading
from pathlib import Path
from typing import Any

import crc32c
import numcodecs
import numpy as np
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec

CODECS: tuple[str, ...] = ("none", "zstd", "blosc-lz4-bitshuffle")
ZSTD_LEVEL = 1  # higher levels gain < 1% on hidden states (measured) and cost encode speed
BLOSC_CLEVEL = 5  # zarr's default; lz4 speed barely depends on it
CRC_BYTES = 4
INDEX_ENTRY_BYTES = 16  # (offset, nbytes) as two uint64 per inner chunk
EMPTY_CHUNK = 2**64 - 1  # the sharding spec's marker for a chunk that was never written
# Chunks are read and checksummed in pieces that fit the L2 cache, so the crc32c pass reads cached
# bytes instead of memory (warm reads: ~0.25x -> ~0.6x a raw read; docs/benchmarks.md).
READ_PIECE_BYTES = 1 << 20
# Parallel readers take runs of consecutive chunks, each through its own descriptor, so readahead
# sees long sequential streams (cold reads: ~0.6x -> ~0.8x a raw read); 64 MiB runs still split a
# shard into enough tasks to keep the threads busy to the end.
READ_RUN_BYTES = 64 << 20


class ChunkError(ValueError):
    """A data file does not match its metadata or its checksums (the message names file and
    chunk)."""


def check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is not one of {', '.join(CODECS)}")


def zarr_compressors(codec: str, itemsize: int) -> list[Any]:
    """The bytes-to-bytes codecs of an inner chunk, in zarr's terms; crc32c always comes last."""
    check_codec(codec)
    if codec == "zstd":
        return [ZstdCodec(level=ZSTD_LEVEL, checksum=False), Crc32cCodec()]
    if codec == "blosc-lz4-bitshuffle":
        return [
            BloscCodec(cname="lz4", clevel=BLOSC_CLEVEL, shuffle="bitshuffle", typesize=itemsize),
            Crc32cCodec(),
        ]
    return [Crc32cCodec()]


def _compressor(codec: str, itemsize: int) -> Any | None:
    """The numcodecs object that produces exactly the bytes zarr's codec of the same name would."""
    if codec == "zstd":
        return numcodecs.Zstd(level=ZSTD_LEVEL, checksum=False)
    if codec == "blosc-lz4-bitshuffle":
        return numcodecs.Blosc(
            cname="lz4", clevel=BLOSC_CLEVEL, shuffle=numcodecs.Blosc.BITSHUFFLE, typesize=itemsize
        )
    return None


# Decoders read their parameters from the frame header; decode is stateless, so threads share them.
_DECODERS = {"zstd": numcodecs.Zstd(), "blosc-lz4-bitshuffle": numcodecs.Blosc()}


def balanced_chunk_rows(num_rows: int, max_rows: int) -> int:
    """Inner chunk length <= max_rows that splits num_rows into equal chunks, so the padding of the
    last chunk (zarr stores edge chunks whole) stays below the number of chunks."""
    n = max(1, math.ceil(num_rows / max_rows))
    return max(1, math.ceil(num_rows / n))


@dataclasses.dataclass(frozen=True)
class ArrayLayout:
    """What the reader needs to know about one array's data file, parsed from its zarr.json."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_rows: int
    codec: str

    @property
    def n_chunks(self) -> int:
        return max(1, math.ceil(self.shape[0] / self.chunk_rows))

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    @property
    def key(self) -> str:
        return "c/" + "/".join("0" for _ in self.shape)  # one shard per dimension

    def rows(self, i: int) -> tuple[int, int]:
        """Row range [start, stop) of inner chunk i inside the array (the last may be short)."""
        start = i * self.chunk_rows
        return start, min(start + self.chunk_rows, self.shape[0])


def create_array(
    group: Any,
    name: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    chunk_rows: int,
    codec: str,
    attributes: dict[str, Any],
    dimension_names: tuple[str, ...],
) -> ArrayLayout:
    """Write the zarr.json of one array (through zarr); its data file is written by `write_data`."""
    layout = ArrayLayout(tuple(shape), np.dtype(dtype), chunk_rows, codec)
    inner = (chunk_rows, *shape[1:])
    group.create_array(
        name=name,
        shape=shape,
        dtype=layout.dtype,
        chunks=inner,
        shards=(layout.n_chunks * chunk_rows, *shape[1:]),
        serializer=BytesCodec(endian="little"),
        compressors=zarr_compressors(codec, layout.dtype.itemsize),
        filters=None,
        fill_value=0,
        attributes=attributes,
        dimension_names=dimension_names,
    )
    return layout


def _codec_name(inner: list[dict[str, Any]]) -> str:
    names = [c.get("name") for c in inner]
    if names[:1] != ["bytes"] or names[-1:] != ["crc32c"] or len(names) > 3:
        raise ChunkError(f"inner codecs {names} are not bytes -> [compressor] -> crc32c")
    if inner[0].get("configuration", {}).get("endian", "little") != "little":
        raise ChunkError("inner chunks are not little endian")
    middle = names[1:-1]
    if not middle:
        return "none"
    if middle == ["zstd"]:
        return "zstd"
    if middle == ["blosc"] and inner[1]["configuration"].get("shuffle") == "bitshuffle":
        return "blosc-lz4-bitshuffle"
    raise ChunkError(f"inner compressor {inner[1]} is not one this format uses")


def parse_layout(meta: dict[str, Any]) -> ArrayLayout:
    """zarr.json of an array -> its layout; anything this format never writes is a ChunkError."""
    try:
        (sharding,) = meta["codecs"]
        cfg = sharding["configuration"]
        shape, inner_shape = tuple(meta["shape"]), tuple(cfg["chunk_shape"])
        outer = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        ok = (
            sharding["name"] == "sharding_indexed"
            and cfg.get("index_location", "end") == "end"
            and [c["name"] for c in cfg["index_codecs"]] == ["bytes", "crc32c"]
            and inner_shape[1:] == shape[1:]
            and outer[1:] == shape[1:]
            and outer[0] >= shape[0]
            and meta["chunk_key_encoding"]["configuration"]["separator"] == "/"
        )
        codec = _codec_name(cfg["codecs"])
        dtype = np.dtype(meta["data_type"])
    except (KeyError, TypeError, ValueError) as e:
        raise ChunkError(f"array metadata is not a sharded array of this format ({e!r})") from e
    if not ok:
        raise ChunkError("array metadata is not a single-shard sharded array of this format")
    return ArrayLayout(shape, dtype, inner_shape[0], codec)


def _crc(data: Any, crc: int = 0) -> int:
    """crc32c of any contiguous buffer. The `crc32c` package releases the GIL while it computes
    (google_crc32c does not: a reader thread checksumming 1 MiB pieces held the training loop's
    thread to 16% of its speed), so reader and writer threads never stall the thread feeding the
    GPU."""
    return crc32c.crc32c(data, crc)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def write_data(array_dir: Path, layout: ArrayLayout, data: np.ndarray) -> int:
    """Encode `data` chunk by chunk into the array's shard file; returns the bytes written."""
    if data.shape != layout.shape:
        raise ValueError(
            f"data of shape {data.shape} does not fit an array of shape {layout.shape}"
        )
    data = np.ascontiguousarray(data, dtype=layout.dtype.newbyteorder("<"))
    compressor = _compressor(layout.codec, layout.dtype.itemsize)
    path = array_dir / layout.key
    path.parent.mkdir(parents=True, exist_ok=True)
    index = np.empty((layout.n_chunks, 2), dtype="<u8")  # [n, (offset, nbytes)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        offset = 0
        for i in range(layout.n_chunks):
            chunk = _padded_chunk(data, layout, i)  # [chunk_rows, ...]
            encoded = memoryview(chunk if compressor is None else compressor.encode(chunk)).cast(
                "B"
            )
            crc = struct.pack("<I", _crc(encoded))
            _write_all(fd, encoded)
            _write_all(fd, memoryview(crc))
            index[i] = (offset, len(encoded) + CRC_BYTES)
            offset += len(encoded) + CRC_BYTES
        index_bytes = index.tobytes()
        _write_all(fd, memoryview(index_bytes + struct.pack("<I", _crc(index_bytes))))
    finally:
        os.close(fd)
    return offset + len(index_bytes) + CRC_BYTES


def _padded_chunk(data: np.ndarray, layout: ArrayLayout, i: int) -> np.ndarray:
    """Rows of chunk i; the last chunk is padded with zeros (the fill value) to chunk_rows rows."""
    start, stop = layout.rows(i)
    if stop - start == layout.chunk_rows:
        return data[start:stop]
    chunk = np.zeros((layout.chunk_rows, *layout.shape[1:]), dtype=data.dtype)
    chunk[: stop - start] = data[start:stop]
    return chunk


_scratch = threading.local()  # per-thread buffers: compressed bytes, and a padded last chunk


def _scratch_buffer(name: str, nbytes: int) -> np.ndarray:
    """A reusable uint8 buffer of at least nbytes for this thread (fresh pages are slow to fault
    in)."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        setattr(_scratch, name, buf)
    return buf[:nbytes]


def _pread_into(fd: int, views: list[memoryview], offset: int, path: Path) -> None:
    """Fill `views` from the file at `offset`; a short read means the file was cut."""
    want = sum(v.nbytes for v in views)
    while views:
        got = os.preadv(fd, views, offset)
        if got == 0:
            raise ChunkError(f"{path} ends early (wanted {want} bytes at offset {offset - want})")
        offset += got
        while views and got >= views[0].nbytes:
            got -= views[0].nbytes
            views.pop(0)
        if views and got:
            views[0] = views[0][got:]


def _pieces(views: list[memoryview]) -> list[memoryview]:
    """Split buffers into READ_PIECE_BYTES pieces, in order (empty buffers dropped)."""
    return [
        v[i : i + READ_PIECE_BYTES] for v in views for i in range(0, v.nbytes, READ_PIECE_BYTES)
    ]


def _check_crc(payload: Any, stored: bytes, what: str) -> None:
    if _crc(payload) != struct.unpack("<I", stored)[0]:
        raise ChunkError(f"{what} fails its crc32c checksum")


class ArrayFile:
    """An open shard file of one array: its checked index, and per-chunk reads into caller buffers.

    `read_chunk(s)` may run on several threads at once (positional reads, per-thread scratch)."""

    def __init__(self, path: Path, layout: ArrayLayout, fd: int, index: np.ndarray):
        self.path = path
        self.layout = layout
        self.fd = fd
        self.index = index  # [n_chunks, 2] (offset, nbytes)

    @classmethod
    def open_expecting(cls, array_dir: Path, shape: tuple[int, ...], dtype: np.dtype) -> ArrayFile:
        """Open an array after checking its zarr.json describes `shape` and `dtype`."""
        try:
            meta = json.loads((array_dir / "zarr.json").read_bytes())
        except FileNotFoundError:
            raise ChunkError(
                f"array {array_dir.name} is missing (no {array_dir / 'zarr.json'})"
            ) from None
        layout = parse_layout(meta)
        if layout.shape != tuple(shape) or layout.dtype != dtype:
            raise ChunkError(
                f"array {array_dir.name} is {layout.dtype} {layout.shape}, expected {dtype} "
                f"{tuple(shape)}"
            )
        return cls.open(array_dir, layout)

    @classmethod
    def open(cls, array_dir: Path, layout: ArrayLayout) -> ArrayFile:
        path = array_dir / layout.key
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ChunkError(f"data file {path} is missing") from None
        try:
            return cls(path, layout, fd, _read_index(fd, path, layout))
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> ArrayFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def runs(self) -> list[range]:
        """The chunks in runs of about READ_RUN_BYTES: units of work for parallel readers."""
        per = max(1, READ_RUN_BYTES // max(1, self.layout.chunk_rows * self.layout.row_bytes))
        n = self.layout.n_chunks
        return [range(i, min(i + per, n)) for i in range(0, n, per)]

    def read_chunks(self, chunks: range, out: np.ndarray) -> None:
        """read_chunk for a run of chunks through a private descriptor: the kernel's readahead is
        per open file, and sees one sequential stream instead of threads interleaving on one fd."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i in chunks:
                self.read_chunk(i, out, fd)
        finally:
            os.close(fd)

    def read_chunk(self, i: int, out: np.ndarray, fd: int | None = None) -> None:
        """Decode inner chunk i into its rows of `out` (the whole array's buffer, C-contiguous)."""
        start, stop = self.layout.rows(i)
        dest = out[start:stop]
        # the last chunk is stored padded
        full_bytes = self.layout.chunk_rows * self.layout.row_bytes
        if self.layout.codec == "none":  # the stored bytes are the values: read them into place
            pad = _scratch_buffer("pad", full_bytes - dest.nbytes)
            self._read_checked(i, [memoryview(dest).cast("B"), memoryview(pad)], fd)
            return
        encoded = _scratch_buffer("encoded", int(self.index[i, 1]) - CRC_BYTES)
        self._read_checked(i, [memoryview(encoded)], fd)
        target = dest if dest.nbytes == full_bytes else _scratch_buffer("decoded", full_bytes)
        try:
            _DECODERS[self.layout.codec].decode(encoded, out=target)
        except Exception as e:  # a decoder error on bytes whose crc matched: the writer was broken
            raise ChunkError(f"chunk {i} of {self.path} does not decompress ({e})") from e
        if target is not dest:
            dest.reshape(-1).view(np.uint8)[:] = target[: dest.nbytes]

    def check_chunk(self, i: int) -> None:
        """Check inner chunk i against its crc32c without decoding it."""
        self._read_checked(
            i, [memoryview(_scratch_buffer("encoded", int(self.index[i, 1]) - CRC_BYTES))]
        )

    def _read_checked(self, i: int, views: list[memoryview], fd: int | None = None) -> None:
        """Read chunk i's stored bytes (less the crc) into `views`, in L2-sized pieces, each one
        checksummed right after its read while it is still in the CPU cache; then compare crc32c."""
        offset, nbytes = (int(v) for v in self.index[i])
        if sum(v.nbytes for v in views) != nbytes - CRC_BYTES:
            raise ChunkError(
                f"chunk {i} of {self.path} has {nbytes} bytes, not what its array needs"
            )
        fd = self.fd if fd is None else fd
        value = 0
        for piece in _pieces(views):
            _pread_into(fd, [piece], offset, self.path)
            value = _crc(piece, value)
            offset += piece.nbytes
        stored = bytearray(CRC_BYTES)
        _pread_into(fd, [memoryview(stored)], offset, self.path)
        if value != struct.unpack("<I", stored)[0]:
            raise ChunkError(f"chunk {i} of {self.path} fails its crc32c checksum")


def _read_index(fd: int, path: Path, layout: ArrayLayout) -> np.ndarray:
    """Read, checksum and sanity-check the shard index at the end of the file."""
    n = layout.n_chunks
    size = os.fstat(fd).st_size
    index_start = size - n * INDEX_ENTRY_BYTES - CRC_BYTES
    if index_start < 0:
        raise ChunkError(f"{path} is too short ({size} bytes) to hold its index")
    raw_size = layout.chunk_rows * layout.row_bytes + CRC_BYTES
    expected = n * (raw_size + INDEX_ENTRY_BYTES) + CRC_BYTES
    # uncompressed: the size is known, say what is wrong
    if layout.codec == "none" and size != expected:
        raise ChunkError(
            f"{path} is {size} bytes, but its array needs {expected} (the file was cut short "
            f"or overwritten)"
        )
    raw = bytearray(n * INDEX_ENTRY_BYTES + CRC_BYTES)
    _pread_into(fd, [memoryview(raw)], index_start, path)
    _check_crc(memoryview(raw)[:-CRC_BYTES], bytes(raw[-CRC_BYTES:]), f"the index of {path}")
    index = np.frombuffer(raw, dtype="<u8", count=2 * n).reshape(n, 2)
    ends = index[:, 0] + index[:, 1]
    if (
        (index == EMPTY_CHUNK).any()
        or (ends > index_start).any()
        or (index[:, 1] <= CRC_BYTES).any()
    ):
        raise ChunkError(f"the index of {path} points outside its data or at missing chunks")
    if layout.codec == "none" and (index[:, 1] != raw_size).any():
        raise ChunkError(f"the index of {path} gives chunk sizes other than {raw_size} bytes")
    return index
