"""One decode step's attention, as dflash-generate's packed_gqa_sdpa runs it, per SDPA backend.

    python benchmarks/decode_attention.py            # GPU: Qwen3-8B's heads, batch 64, bf16
    python benchmarks/decode_attention.py --quick    # CPU smoke run

A one-token step of a grouped-query target: the 4 query heads of each of the 8 key/value heads are
that head's 4 query rows ([B, 8, 4, 128]) over the whole static cache ([B, 8, L, 128]) with an
additive [B, 1, 1, L] mask. Rows: torch's default SDPA choice, each backend forced (those that
refuse the inputs say so), and the same arithmetic as two batched matmuls around a float32 softmax.
us/call is the median of --repeats timings (CUDA events on a GPU) of --calls calls each; GB/s counts
the cache's keys and values read once, the least a step must move. A decode step runs this once per
layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def matmuls(q, k, v, mask, scale):
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale + mask
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


def sdpa(q, k, v, mask, scale, backend: SDPBackend | None):
    """F.scaled_dot_product_attention with torch's own choice of backend (None) or the one named."""
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def us_per_call(fn, calls: int, cuda: bool) -> float:
    """Microseconds a call of fn over `calls` calls in a row: CUDA events on a GPU, the wall clock
    else."""
    if not cuda:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - started) * 1e6 / calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lengths", default="384,1024,4096", help="cache lengths L")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.quick
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.quick:
        args.batch, args.lengths, args.calls, args.repeats = 2, "64", 2, 2
    kv_heads, groups, dim = 8, 4, 128
    ways = {
        "default": None,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "math": SDPBackend.MATH,
    }
    print(
        f"device {device}, {dtype}, batch {args.batch}, "
        f"{kv_heads} kv heads x {groups} query rows x {dim}; "
        f"median of {args.repeats} x {args.calls} calls, [lowest-highest] beside it"
    )
    print(f"| {'L':>5} | {'way':<10} | {'us/call':>20} | {'GB/s':>6} |")
    for length in map(int, args.lengths.split(",")):
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(args.batch, kv_heads, groups, dim, device=device, dtype=dtype, generator=g)
        k = torch.randn(args.batch, kv_heads, length, dim, device=device, dtype=dtype, generator=g)
        v = torch.randn_like(k)
        mask = torch.zeros(args.batch, 1, 1, length, device=device, dtype=dtype)
        mask[:, :, :, length * 3 // 4 :] = torch.finfo(dtype).min  # the steps not yet taken
        moved = 2 * k.numel() * k.element_size()
        scale = dim**-0.5
        want = matmuls(q, k, v, mask, scale)
        runs = {
            name: (lambda b=backend: sdpa(q, k, v, mask, scale, b))
            for name, backend in ways.items()
        }
        runs["matmuls"] = lambda: matmuls(q, k, v, mask, scale)
        for name, fn in runs.items():
            try:
                got = fn()
            except RuntimeError as e:
                print(f"| {length:>5} | {name:<10} | {'refused: ' + str(e).splitlines()[0][:60]} |")
                continue
            err = (got.float() - want.float()).abs().max().item()
            times = [us_per_call(fn, args.calls, cuda) for _ in range(args.repeats)]
            us = statistics.median(times)
            cell = f"{us:,.1f} [{min(times):,.1f}-{max(times):,.1f}]"
            print(
                f"| {length:>5} | {name:<10} | {cell:>20} | {moved / us / 1e3:>6,.0f} "
                f"| max err {err:.1e}"
            )


if __name__ == "__main__":
    main()
