"""Where a benchmark's GPU time goes: `kernel_table(fn, ...)` runs `fn` under torch.profiler and prints
its kernels grouped by name, the largest first, as a table (benchmarks' `--profile`).

Each row: total device ms per call of `fn`, share of the summed kernel time, launches per call, and the
kernel's name cut to fit. The last rows say how much of the wall time the kernels filled: a busy share
well under 100% means the device waited for the host (launches, syncs, Python).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch


def _kernel_events(prof) -> list:
    events = []
    for e in prof.events():
        # user annotations (e.g. "Optimizer.step#AdamW.step") span kernels listed on their own: skip them
        annotation = getattr(e, "is_user_annotation", False) or "#" in e.name
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and not annotation:
            events.append(e)
    return events


def kernel_table(fn: Callable[[], object], calls: int = 3, rows: int = 25, title: str = "",
                 width: int = 90) -> str:
    """Profile `calls` calls of fn (warmed up by the caller) and return the printed table."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1e3 / calls
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in _kernel_events(prof):
        entry = by_name[e.name]
        entry[0] += e.device_time_total / 1e3  # us -> ms
        entry[1] += 1
    total = sum(ms for ms, _ in by_name.values()) / calls
    lines = [f"## {title}: kernels per call (of {calls} profiled), wall {wall_ms:.2f} ms, kernels {total:.2f} ms "
             f"({total / wall_ms:.0%} busy)",
             f"| {'ms/call':>8} | {'share':>6} | {'launches':>8} | {'kernel':<{width}} |",
             f"|{'-' * 10}|{'-' * 8}|{'-' * 10}|{'-' * (width + 2)}|"]
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    for name, (ms, n) in ranked[:rows]:
        lines.append(f"| {ms / calls:>8.3f} | {ms / calls / total:>6.1%} | {n / calls:>8.0f} | {name[:width]:<{width}} |")
    rest = ranked[rows:]
    if rest:
        ms, n = sum(r[1][0] for r in rest), sum(r[1][1] for r in rest)
        lines.append(f"| {ms / calls:>8.3f} | {ms / calls / total:>6.1%} | {n / calls:>8.0f} | "
                     f"{f'({len(rest)} other kernels)':<{width}} |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text
