"""LM-head loss, forward + backward: our fused loss vs plain PyTorch vs Liger-Kernel.

    PYTHONPATH=. python benchmarks/loss.py            # on a GPU: the two sizes of the goal, bf16
    PYTHONPATH=. python benchmarks/loss.py --quick    # CPU smoke run at tiny sizes

Time is the median over repetitions (CUDA events on a GPU); peak memory is the largest allocation
above what the inputs (hidden, lm_head, labels, weights) already hold, over one forward + backward.
Rows: our loss with every row weighted, our loss with DFlash block weights (position 0 of every
16-token block has weight 0 and is skipped), plain PyTorch (logits + F.cross_entropy) and, when
importable, Liger-Kernel's LigerFusedLinearCrossEntropyLoss (which applies no per-token weights).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_common.drafter.loss import fused_lm_head_loss  # noqa: E402
from dflash_common.drafter.objective import default_gamma  # noqa: E402

GOAL_SIZES = [(16384, 4096, 151936), (65536, 5120, 248320)]  # (N, H, V)
QUICK_SIZES = [(256, 64, 1000), (512, 96, 2003)]
BLOCK = 16  # DFlash block size: 1 row in 16 carries weight 0


def make_inputs(n, h, v, device, dtype, block_weights: bool):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=g).requires_grad_(True)
    weight = (torch.randn(v, h, device=device, dtype=dtype, generator=g) * h**-0.5).requires_grad_(False)
    labels = torch.randint(0, v, (n,), device=device, generator=g)
    weights = torch.ones(n, device=device)
    if block_weights:
        k = torch.arange(n, device=device) % BLOCK
        weights = torch.where(k == 0, 0.0, torch.exp(-(k - 1).clamp(min=0) / default_gamma(BLOCK)))
    return hidden, weight, labels, weights


def ours(backend):
    def run(hidden, weight, labels, weights):
        return fused_lm_head_loss(hidden, weight, labels, weights, backend=backend).loss
    return run


def plain_torch(hidden, weight, labels, weights):
    logits = hidden @ weight.T  # [N, V] materialised
    return (F.cross_entropy(logits.float(), labels, reduction="none") * weights).sum()


def liger():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    module = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def run(hidden, weight, labels, weights):
        return module(weight, hidden, labels)  # no per-token weights
    return run


def measure(fn, inputs, reps: int) -> tuple[float, float | None, tuple[float, float]]:
    """(median ms, peak GiB above the inputs, (lowest, highest) ms) of fn(*inputs).backward()."""
    hidden = inputs[0]
    cuda = hidden.is_cuda
    times, peak = [], 0
    for i in range(reps + 2):  # two warm-up runs (compilation, allocator)
        hidden.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn(*inputs).backward()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        else:
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= 2:
            times.append(elapsed)
    hidden.grad = None
    return statistics.median(times), (peak / 2**30 if cuda else None), (min(times), max(times))


def rows_for(device) -> list[tuple[str, object, bool]]:
    backends = ["triton", "torch"] if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]
    rows = [(f"dflash fused [{b}], all rows weighted", ours(b), False) for b in backends]
    rows += [(f"dflash fused [{b}], block weights (1/16 skipped)", ours(b), True) for b in backends]
    rows.append(("plain PyTorch (logits + F.cross_entropy)", plain_torch, False))
    rows.append(("Liger fused linear CE (no token weights)", liger(), False))
    return rows


def sweep(sizes, device, dtype, reps: int) -> None:
    """Chunk height vs time and memory: how the default chunk budget was chosen."""
    print(f"| {'chunk rows':>10} | {'N, H, V':<20} | {'ms':>9} | {'peak GiB':>9} |")
    for n, h, v in sizes:
        inputs = make_inputs(n, h, v, device, dtype, False)
        for rows in (256, 384, 512, 640, 768, 1024, 1280, 1536, 2048):
            def fn(hidden, weight, labels, weights, rows=rows):
                chunk_bytes = rows * v * weight.element_size()
                return fused_lm_head_loss(hidden, weight, labels, weights, chunk_bytes=chunk_bytes).loss
            ms, peak, _ = measure(fn, inputs, reps)
            print(f"| {rows:>10} | {f'{n}, {h}, {v}':<20} | {ms:>9.1f} | {peak or 0:>9.2f} |")
        del inputs


def kernel_sweep(device, dtype, rows: int = 512, vocab: int = 151936, reps: int = 20) -> None:
    """The row kernel alone on one logits chunk [rows, vocab] (forward + gradient in place) per
    (columns per step, warps): ms and GB/s counting its three passes over the chunk (read, read, write)."""
    from dflash_common.drafter.loss_triton import weighted_ce_rows

    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, dtype=dtype, generator=g) * 4
    labels = torch.randint(0, vocab, (rows,), device=device, generator=g)
    weights = torch.ones(rows, device=device)
    moved = 3 * logits.numel() * logits.element_size()
    print(f"| {'columns/step':>12} | {'warps':>5} | {'ms':>7} | {'GB/s':>7} |")
    for block, warps in ((4096, 8), (4096, 16), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32)):
        times = []
        for i in range(reps + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            weighted_ce_rows(logits, labels, weights, True, block=block, num_warps=warps)
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        print(f"| {block:>12} | {warps:>5} | {ms:>7.3f} | {moved / ms / 1e6:>7.0f} |", flush=True)


def profile(size, device, dtype) -> None:
    from benchmarks.profiling import kernel_table

    n, h, v = size
    for label, fn, block_weights in rows_for(device):
        if fn is None or label.startswith("plain"):
            continue
        inputs = make_inputs(n, h, v, device, dtype, block_weights)
        measure(fn, inputs, 1)  # warm-up

        def once(fn=fn, inputs=inputs):
            inputs[0].grad = None
            fn(*inputs).backward()

        kernel_table(once, calls=3, title=f"{label}, N={n}")
        del inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (smoke test)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="print the kernels of our loss and Liger's (CUDA)")
    parser.add_argument("--kernel-sweep", action="store_true",
                        help="time the row kernel alone per (columns per step, warps) on one chunk (CUDA)")
    parser.add_argument("--sizes", default="all", choices=["all", "first"], help="'first': only N=16384")
    parser.add_argument("--sweep", action="store_true",
                        help="time our Triton loss at several fixed chunk heights (rows) instead of the table")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = QUICK_SIZES if args.quick else GOAL_SIZES[:1] if args.sizes == "first" else GOAL_SIZES
    reps = 3 if args.quick else args.reps
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"# LM-head loss forward+backward on {name}, {str(dtype).removeprefix('torch.')}, median of {reps}")
    print(f"| {'loss':<52} | {'N, H, V':<20} | {'ms':>9} | {'spread ms':>15} | {'peak GiB':>9} |")
    print(f"|{'-' * 54}|{'-' * 22}|{'-' * 11}|{'-' * 17}|{'-' * 11}|")
    if args.sweep:
        return sweep(sizes, device, dtype, reps)
    if args.profile and device.type == "cuda":
        return profile(sizes[0], device, dtype)
    if args.kernel_sweep and device.type == "cuda":
        return kernel_sweep(device, dtype)
    for n, h, v in sizes:
        for label, fn, block_weights in rows_for(device):
            size = f"{n}, {h}, {v}"
            if fn is None:
                print(f"| {label:<52} | {size:<20} | {'skipped: liger-kernel not installed':<39} |")
                continue
            inputs = make_inputs(n, h, v, device, dtype, block_weights)
            try:
                ms, peak, (lo, hi) = measure(fn, inputs, reps)
                peak_text = "n/a" if peak is None else f"{peak:.2f}"
                print(f"| {label:<52} | {size:<20} | {ms:>9.1f} | {f'{lo:.1f}-{hi:.1f}':>15} | {peak_text:>9} |")
            except torch.OutOfMemoryError:
                print(f"| {label:<52} | {size:<20} | {'OOM':>9} | {'':>15} | {'OOM':>9} |")
            del inputs
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
