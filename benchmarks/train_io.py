"""Trainer I/O: does reading the store from disk slow training down?

In one run, the same drafter trains on the same batches twice:
1. resident: the batches of the plan, decoded and already on the GPU, no data path at all;
2. from disk: the same batches, in the same order, through the trainer's data path (reader threads
   -> pinned slot cache -> one batch on the GPU plus one in flight), with a cache smaller than the
   store and the store's pages dropped from the page cache (posix_fadvise DONTNEED) first, so shards
   really come from the disk.

The two phases alternate `--repeats` times (resident, disk, resident, disk, ...). It prints the
median tok/s of each phase with its spread (lowest-highest repeat), the median data-stall fraction
(host time blocked waiting for a batch), the peak GPU memory, the cache hits of the disk phases, and
the ratio of the medians from-disk / resident (goal: >= 0.99).

The script is self-contained: it writes its own store of random states with a Qwen3-8B-like shape
(hidden 4096, 5 target layers, vocabulary 151,936, 5 draft layers) through the store API: 18
shards of 32,768 tokens (24 GB in bf16), shuffle windows of 4 shards (eight 16,384-token batches),
so the cache (half the store) holds two windows and every epoch reads the store again.

    python benchmarks/train_io.py                    # on a CUDA GPU (writes ~24 GB under --workdir)
    python benchmarks/train_io.py --quick            # tiny sizes, any CPU: a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import Spread  # noqa: E402
from dflash_common.config import load_config  # noqa: E402
from dflash_common.drafter.config import DrafterConfig  # noqa: E402
from dflash_common.drafter.model import DFlashDrafter  # noqa: E402
from dflash_common.store import (
    ShardPayload,
    Store,
    StoreManifest,
    StoreWriter,
    encode_states,
    shard_name,
)  # noqa: E402
from dflash_common.fsutil import human_bytes  # noqa: E402
from dflash_common.store.quant import STORAGE_DTYPES, token_bytes  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.data import TrainData  # noqa: E402
from train.loop import _N, _TOKENS, _WAIT, train_step  # noqa: E402
from train.optim import build_optimizer  # noqa: E402

# Qwen3-8B: hidden 4096, 32 heads of 128, 8 KV heads, MLP 12288, vocabulary 151,936, 36 layers.
FULL = dict(
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=12288,
    vocab=151936,
    target_layers=36,
    layer_ids=[1, 9, 17, 25, 33],
    depth=5,
    block=16,
    anchors=256,
    store_gb=24.0,
    shard_tokens=32768,
    window=4,
    batch_tokens=16384,
    seq_min=512,
    seq_max=3072,
    steps=30,
    warmup=3,
)
# from disk / resident, every storage dtype (bf16 and fp8_e4m3 met 1.000 and 1.003 on 2026-12-01)
GOAL = 0.99
# 16,384 tokens x 256 anchors per batch: ~37K block rows, ~60 GB of activations for this drafter on
# one GPU (measured ~1.6 MB per block row); 65,536 tokens x 512 anchors would not fit in 141 GB.
QUICK = dict(
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    vocab=320,
    target_layers=8,
    layer_ids=[1, 3, 5],
    depth=1,
    block=8,
    anchors=16,
    store_gb=0.004,
    shard_tokens=2048,
    window=1,
    batch_tokens=1024,
    seq_min=64,
    seq_max=300,
    steps=4,
    warmup=1,
)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes: a smoke test that runs on a CPU in seconds",
    )
    p.add_argument(
        "--workdir", default=None, help="where to write the synthetic store (default: a temp dir)"
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the synthetic store (reused by a later run)"
    )
    p.add_argument(
        "--dtype", default="bf16", choices=list(STORAGE_DTYPES), help="storage dtype of the store"
    )
    p.add_argument("--store-gb", type=float, help="size of the synthetic store")
    p.add_argument(
        "--cache-fraction", type=float, default=0.5, help="shard cache size / store size (< 1)"
    )
    p.add_argument("--steps", type=int, help="timed optimiser steps per phase")
    p.add_argument(
        "--anchors",
        type=int,
        help="anchors (blocks) per sequence (default 256; 128 fits an 80 GB H100: half the "
        "compute per batch, so the store must be read twice as fast, a stricter test)",
    )
    p.add_argument(
        "--repeats", type=int, help="rounds of (resident, disk) phases (default 3; 2 with --quick)"
    )
    p.add_argument("--reader-threads", type=int, default=8)
    p.add_argument("--gpu-prefetch", type=int, default=1, choices=[0, 1])
    p.add_argument(
        "--resident-batches",
        type=int,
        default=None,
        help="cap on the batches held on the GPU for the resident phase "
        "(0.7 GB each at full size); "
        "default: every batch of the phase, so that both phases train exactly the same batches. "
        "A cap cycles them, and the phases then compare different batches",
    )
    return p.parse_args()


def write_store(path: Path, s: dict, dtype: str, device: torch.device) -> Store:
    """Random states [T, H] per layer (generated on `device`), random token ids, loss on every
    token."""
    if (path / "zarr.json").is_file():
        return Store.open(path)
    manifest = StoreManifest(
        target={"name": "synthetic-qwen3-8b-shape"},
        tokenizer={"sha256": "synthetic"},
        chat_template_sha256=None,
        layer_ids=tuple(s["layer_ids"]),
        hidden_size=s["hidden"],
        dtype=dtype,
    )
    writer = StoreWriter.create_or_open(path, manifest)
    per_token = len(s["layer_ids"]) * token_bytes(dtype, s["hidden"])
    n_shards = max(4, int(s["store_gb"] * 1e9 / (per_token * s["shard_tokens"])))
    g = torch.Generator().manual_seed(0)
    for unit in range(n_shards):
        lengths = []
        while sum(lengths) < s["shard_tokens"]:
            lengths.append(int(torch.randint(s["seq_min"], s["seq_max"] + 1, (1,), generator=g)))
        t = sum(lengths)
        layers = {
            i: encode_states(torch.randn(t, s["hidden"], device=device), dtype)
            for i in s["layer_ids"]
        }
        layers = {
            i: dataclasses.replace(
                e, data=e.data.cpu(), scale=None if e.scale is None else e.scale.cpu()
            )
            for i, e in layers.items()
        }
        sample_ids = [f"synthetic:{unit}:{k}" for k in range(len(lengths))]
        payload = ShardPayload(
            input_ids=torch.randint(0, s["vocab"], (t,), generator=g, dtype=torch.int32),
            loss_mask=torch.ones(t, dtype=torch.uint8),
            offsets=torch.tensor([0] + lengths).cumsum(0).numpy(),
            sample_ids=sample_ids,
            layers=layers,
        )
        writer.write_shard(
            shard_name(unit, hashlib.sha256(str(unit).encode()).hexdigest()), payload
        )
    writer.write_summary({"synthetic": True, "shards": n_shards})  # complete: no warning on open
    return Store.open(path)


def drop_page_cache(path: Path) -> bool:
    """Ask the kernel to forget the store's pages, so the next reads hit the disk."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def make_drafter(s: dict, device: torch.device) -> DFlashDrafter:
    cfg = DrafterConfig(
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["depth"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        vocab_size=s["vocab"],
        num_target_layers=s["target_layers"],
        target_layer_ids=tuple(s["layer_ids"]),
        mask_token_id=s["vocab"] - 1,
        layer_types=("full_attention",) * s["depth"],
        block_size=s["block"],
    )
    torch.manual_seed(0)
    with torch.device(
        device
    ):  # initialise in place: a 1B-parameter drafter is slow to build on a CPU
        drafter = DFlashDrafter(cfg)
    head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = torch.randn(s["vocab"], s["hidden"], device=device, dtype=head_dtype) * 0.02
    drafter.attach_frozen(embed, torch.randn_like(embed) * 0.02)
    return drafter


def timed_phase(drafter, batches, cfg, steps: int, warmup: int, device: torch.device) -> dict:
    """Train `warmup` + `steps` optimiser steps from `batches`; time the last `steps`."""
    optimizer, scheduler = build_optimizer(cfg.optim, drafter, warmup + steps, device)
    sums = torch.zeros(_N + 1, dtype=torch.float64, device=device)
    counts = torch.zeros(2 * drafter.cfg.block_size + 2, dtype=torch.float64, device=device)
    for _ in range(warmup):  # compilation of the attention kernels, allocator warm-up
        train_step(drafter, drafter, batches, optimizer, scheduler, cfg, sums, counts)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    sums.zero_()
    started = time.perf_counter()
    for _ in range(steps):
        train_step(drafter, drafter, batches, optimizer, scheduler, cfg, sums, counts)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return {
        "tok_s": float(sums[_TOKENS]) / wall,
        "stall": float(sums[_WAIT]) / wall,
        "peak_gb": peak,
        "wall": wall,
    }


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} GB"


def main() -> None:
    args = parse()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    s = dict(QUICK if args.quick else FULL)
    if args.store_gb:
        s["store_gb"] = args.store_gb
    if args.anchors:
        s["anchors"] = args.anchors
    steps = args.steps or s["steps"]
    repeats = args.repeats or (2 if args.quick else 3)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-train-io-"))
    store_path = workdir / f"store-{'quick' if args.quick else 'full'}-{args.dtype}"
    started = time.perf_counter()
    store = write_store(store_path, s, args.dtype, device)
    store_bytes = sum(store.shard_nbytes(i.name, s["layer_ids"]) for i in store.shards)
    print(
        f"store: {len(store.shards)} shards, {human_bytes(store_bytes)} of states ({args.dtype}), "
        f"written in {time.perf_counter() - started:.0f} s"
    )
    try:
        run(args, s, store, store_path, store_bytes, steps, repeats, device)
    finally:
        store.close()
        if not args.keep:
            shutil.rmtree(store_path, ignore_errors=True)


def run(args, s, store, store_path, store_bytes, steps, repeats, device) -> None:
    autocast = "bf16" if device.type == "cuda" else "none"
    biggest = max(store.shard_nbytes(i.name, s["layer_ids"]) for i in store.shards)
    # the trainer's minimum
    cache_bytes = max(args.cache_fraction * store_bytes, 2 * s["window"] * biggest * 1.001)
    print(f"cache: {human_bytes(cache_bytes)} = {cache_bytes / store_bytes:.0%} of the store")
    cfg = load_config(
        TrainConfig,
        None,
        [
            f'--data.stores=["{store_path}"]',
            f"--data.cache_gb={cache_bytes / 1e9}",
            f"--data.reader_threads={args.reader_threads}",
            f"--data.batch_tokens={s['batch_tokens']}",
            f"--data.window_shards={s['window']}",
            f"--data.gpu_prefetch={args.gpu_prefetch}",
            "--data.holdout_sequences=0",
            f"--drafter.block_size={s['block']}",
            f"--objective.max_anchors={s['anchors']}",
            f"--precision.autocast={autocast}",
            "--optim.warmup_fraction=0",
        ],
    )
    drafter = make_drafter(s, device)
    total = s["warmup"] + steps

    held = min(total, args.resident_batches or total)
    gpu, disk, dropped, stats = [], [], True, []
    for _ in range(repeats):  # interleaved: a slow spell of the shared machine hits both phases
        resident = resident_batches(cfg, store, s["layer_ids"], held, device)
        gpu.append(timed_phase(drafter, itertools.cycle(resident), cfg, steps, s["warmup"], device))
        del resident  # freed before the disk phase, whose peak memory is its own
        dropped &= drop_page_cache(store_path)
        data = TrainData.build(cfg, [store], s["layer_ids"], rank=0, world=1, device=device)
        disk.append(timed_phase(drafter, data.start(), cfg, steps, s["warmup"], device))
        stats.append(data.cache.stats)
        data.close()
    report(
        disk,
        gpu,
        stats,
        dropped,
        cache_bytes / store_bytes,
        held,
        steps,
        s["batch_tokens"],
        s["anchors"],
        device,
    )


def resident_batches(cfg, store, layer_ids, held: int, device) -> list:
    """The first `held` batches of the plan (the ones the disk phase trains on), decoded on the
    device."""
    data = TrainData.build(cfg, [store], layer_ids, rank=0, world=1, device=device)
    feeder = data.start()
    try:
        return [dataclasses.replace(next(feeder), data_wait_s=0.0) for _ in range(held)]
    finally:
        data.close()


def report(
    disk: list[dict],
    gpu: list[dict],
    stats: list,
    dropped: bool,
    cache_share: float,
    held: int,
    steps: int,
    batch_tokens: int,
    anchors: int,
    device: torch.device,
) -> None:
    disk_tok, gpu_tok = Spread.of([p["tok_s"] for p in disk]), Spread.of([p["tok_s"] for p in gpu])

    def peak(phases: list[dict]) -> float | None:
        return None if phases[0]["peak_gb"] is None else max(p["peak_gb"] for p in phases)

    print()
    print(
        f"| phase | tok/s, median [lowest-highest] of {len(disk)} | data stall | peak GPU memory |"
    )
    print("| --- | --- | --- | --- |")
    print(
        f"| from disk (cache {cache_share:.0%} of the store, "
        f"page cache {'dropped' if dropped else 'kept'}) "
        f"| {disk_tok.text(',.0f')} | {statistics.median(p['stall'] for p in disk):.1%} "
        f"| {_gb(peak(disk))} |"
    )
    print(
        f"| resident on the {device.type.upper()} (peak includes {held} resident batches) | "
        f"{gpu_tok.text(',.0f')} | - | {_gb(peak(gpu))} |"
    )
    print()
    ratio = disk_tok.median / gpu_tok.median
    print(
        f"from disk / resident = {ratio:.3f} "
        f"(goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'}); "
        f"{steps} steps of {batch_tokens} tokens x {anchors} anchors per phase on {device}"
    )
    for k, st in enumerate(stats):
        print(
            f"cache, disk phase {k + 1}: {st.hits} hits, {st.misses} misses, "
            f"{human_bytes(st.bytes_read)} read "
            f"in {st.read_s:.1f} s of reader time; batches waited {st.wait_s:.2f} s for shards"
        )


if __name__ == "__main__":
    main()
