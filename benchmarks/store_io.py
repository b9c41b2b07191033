"""Store write/read throughput per dtype x codec, cold and warm page cache, beside a raw file read.

    python benchmarks/store_io.py            # H=4096, 5 layers, 2 shards of 8192 tokens per config
    python benchmarks/store_io.py --quick    # tiny sizes: a smoke run in seconds

For each storage dtype and codec it writes `--shards` shards through StoreWriter (fsync and publish
included), then reads them with Store.read_shard into preallocated buffers, and reads a raw file of
exactly the same bytes with one readinto, into the same buffers. "Cold" drops the files' pages with
posix_fadvise(DONTNEED) first (no root needed; on a VM the host may still cache them). Throughput is
MB/s of the bytes a read delivers (token arrays + stored states: fp8 delivers half the bytes of
bf16); each read figure is the median of `--repeat` runs with their spread (lowest-highest), raw and
store runs interleaved; the "x raw" ratios are of the medians. Goal: store reads >= 0.8x the raw
read.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import Spread  # noqa: E402
from dflash_common.store import (  # noqa: E402
    ShardPayload,
    Store,
    StoreManifest,
    StoreWriter,
    buffers_nbytes,
    carve_buffers,
)
from dflash_common.store.chunks import CODECS  # noqa: E402
from dflash_common.store.quant import encode_states  # noqa: E402
from dflash_common.store.verify import store_info  # noqa: E402

DTYPES = ("bf16", "fp8_e4m3")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=5, help="captured layers per token")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per shard")
    p.add_argument("--shards", type=int, default=2, help="shards per dtype x codec")
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--read-threads", type=int, default=4)
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="read runs per figure (the median and spread are reported)",
    )
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--verbose", action="store_true", help="print every run as it ends")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir under $TMPDIR)")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.tokens, args.shards, args.repeat = 256, 2, 1024, 2, 2
        args.chunk_tokens = 256
    return args


def synthetic_states(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """bf16 states [T, H] shaped like a target's: unit-scale noise plus a few massive channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    x[:, torch.randperm(hidden, generator=g)[:4]] *= 100
    return x.to(torch.bfloat16)


def make_payload(args, dtype: str, layer_ids, seed: int) -> ShardPayload:
    t = args.tokens
    lens = [t // 4, t // 4, t - 2 * (t // 4)]
    return ShardPayload(
        input_ids=np.random.default_rng(seed).integers(0, 150_000, t).astype(np.int32),
        loss_mask=np.ones(t, np.uint8),
        offsets=np.cumsum([0, *lens]),
        sample_ids=[f"bench.jsonl:{seed * 3 + i}" for i in range(3)],
        layers={
            i: encode_states(synthetic_states(t, args.hidden, seed * 100 + i), dtype)
            for i in layer_ids
        },
    )


def drop_cache(root: Path) -> None:
    """Evict the pages of a file, or of every file in a tree, from the page cache (fsync first:
    DONTNEED drops clean pages only)."""
    files = [root] if root.is_file() else [Path(d) / f for d, _, fs in os.walk(root) for f in fs]
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_raw(path: Path, views: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as f:
        for v in views.values():
            f.write(memoryview(np.ascontiguousarray(v)).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def read_raw(paths, slab: np.ndarray, nbytes: int) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(slab)[:nbytes], 0
            while got < nbytes:
                got += f.readinto(view[got:])


def write_store(args, path: Path, dtype: str, codec: str) -> float:
    """Write `args.shards` shards; returns the seconds spent in write_shard (fsync, publish
    included)."""
    layer_ids = list(range(1, 1 + 4 * args.layers, 4))
    manifest = StoreManifest(
        target={"name": "synthetic"},
        tokenizer={"sha256": "0"},
        chat_template_sha256=None,
        layer_ids=layer_ids,
        hidden_size=args.hidden,
        dtype=dtype,
        codec=codec,
        chunk_tokens=args.chunk_tokens,
    )
    writer = StoreWriter.create_or_open(path, manifest)
    payloads = [make_payload(args, dtype, layer_ids, seed) for seed in range(args.shards)]
    t0 = time.perf_counter()
    for k, p in enumerate(payloads):
        writer.write_shard(f"u{k:08d}", p)
    return time.perf_counter() - t0


def measure_reads(args, store: Store, raw_dir: Path, label: str) -> tuple[dict, int]:
    """MB/s of store and raw reads, cold and warm (every run's, per key); and the bytes one pass
    reads."""
    specs = store.buffer_specs(store.shards[0])
    nbytes = sum(s.nbytes for s in specs.values())
    slab = np.empty(buffers_nbytes(specs), np.uint8)
    slab.fill(0)  # fault the pages in once, as a long-lived pinned cache slot would be
    views = carve_buffers(specs, slab)
    raw_paths = []
    for s in store.shards:  # a raw file per shard holding exactly the bytes the store read delivers
        store.read_shard(s.name, out=views)
        raw_paths.append(raw_dir / f"raw-{s.name}")
        write_raw(raw_paths[-1], views)
    total = nbytes * len(store.shards)
    mbps_runs: dict[str, list[float]] = {
        "store_cold": [],
        "store_warm": [],
        "raw_cold": [],
        "raw_warm": [],
    }
    runs = {
        "store_cold": (
            [store.path],
            lambda: [store.read_shard(s.name, out=views) for s in store.shards],
        ),
        "raw_cold": (raw_paths, lambda: read_raw(raw_paths, slab, nbytes)),
    }
    for _ in range(args.repeat):
        for cold_key, (files, read) in runs.items():
            for key, drop in ((cold_key, files), (cold_key.replace("cold", "warm"), [])):
                for p in drop:  # a cold run starts with its files evicted; its warm run follows it
                    drop_cache(p)
                t = time.perf_counter()
                read()
                mbps = total / (time.perf_counter() - t) / 1e6
                mbps_runs[key].append(mbps)
                if args.verbose:
                    print(f"  {label} {key}: {mbps:.0f} MB/s", file=sys.stderr)
    for p in raw_paths:
        p.unlink()
    return {key: Spread.of(xs) for key, xs in mbps_runs.items()}, total


def bench_config(args, root: Path, dtype: str, codec: str) -> dict:
    path = root / f"{dtype}-{codec}"
    write_s = write_store(args, path, dtype, codec)
    with Store.open(path, read_threads=args.read_threads) as store:
        reads, total = measure_reads(args, store, root, f"{dtype} {codec}")
        info = store_info(store)
    shutil.rmtree(path)
    return {
        "dtype": dtype,
        "codec": codec,
        "write": total / write_s / 1e6,
        **reads,
        "bytes_per_token": info["bytes_on_disk"] / info["tokens"],
        "ratio": info["compression_ratio"],
    }


def print_table(rows, args) -> None:
    print(
        f"\nmachine: {platform.node()} | {platform.processor() or platform.machine()} | "
        f"{os.cpu_count()} CPUs | torch {torch.__version__}"
    )
    print(
        f"sizes: H={args.hidden}, {args.layers} layers, "
        f"{args.shards} shards x {args.tokens} tokens, "
        f"chunk_tokens={args.chunk_tokens}, read_threads={args.read_threads}, "
        f"median [lowest-highest] of {args.repeat} runs\n"
    )
    print(
        "| dtype | codec | write MB/s | read cold MB/s | raw cold MB/s | cold x raw "
        "| read warm MB/s | raw warm MB/s | warm x raw | bytes/token | decoded/disk |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        sc, rc, sw, rw = (r[k] for k in ("store_cold", "raw_cold", "store_warm", "raw_warm"))
        print(
            f"| {r['dtype']} | {r['codec']} | {r['write']:.0f} "
            f"| {sc.text('.0f')} | {rc.text('.0f')} "
            f"| {sc.median / rc.median:.2f} | {sw.text('.0f')} | {rw.text('.0f')} "
            f"| {sw.median / rw.median:.2f} | {r['bytes_per_token']:,.0f} | {r['ratio']:.3f} |"
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="dflash-store-io-", dir=args.dir))
    rows = []
    try:
        for dtype in args.dtypes.split(","):
            for codec in args.codecs.split(","):
                rows.append(bench_config(args, root, dtype, codec))
                print(f"done {dtype} {codec}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows, args)


if __name__ == "__main__":
    main()
