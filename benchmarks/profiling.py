"""Where a benchmark's GPU time goes: `kernel_table(fn, ...)` runs `fn` under torch.profiler and
prints its kernels grouped by name, the largest first, as a table (benchmarks' `--profile`).

Each row: total device ms per call of `fn`, share of the summed kernel time, launches per call, and
the kernel's name cut to fit. The last rows say how much of the wall time the kernels filled: a busy
share well under 100% means the device waited for the host (launches, syncs, Python).

`timeline(prof, wall_s)` reads a whole phase's trace (several threads, several streams) into a
`Timeline`: GPU busy and idle time, the gaps in the GPU's work, kernel time per stream, copies per
direction and stream, the runtime calls of the thread that launched the kernels (syncs, copies), and
the mean time of each kernel; `compare_timelines` prints phases side by side
(`benchmarks/precompute.py --profile`: the plain forward against the pipeline). `GilProbe` measures
how long a thread waits for the GIL while a phase runs.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections import defaultdict
from typing import Callable

import torch


def _kernel_events(prof) -> list:
    events = []
    for e in prof.events():
        # user annotations (e.g. "Optimizer.step#AdamW.step") span kernels listed on their own:
        # skip them
        annotation = getattr(e, "is_user_annotation", False) or "#" in e.name
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and not annotation:
            events.append(e)
    return events


def kernel_table(
    fn: Callable[[], object], calls: int = 3, rows: int = 25, title: str = "", width: int = 90
) -> str:
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
    lines = [
        f"## {title}: kernels per call (of {calls} profiled), wall {wall_ms:.2f} ms, "
        f"kernels {total:.2f} ms ({total / wall_ms:.0%} busy)",
        f"| {'ms/call':>8} | {'share':>6} | {'launches':>8} | {'kernel':<{width}} |",
        f"|{'-' * 10}|{'-' * 8}|{'-' * 10}|{'-' * (width + 2)}|",
    ]
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    for name, (ms, n) in ranked[:rows]:
        lines.append(
            f"| {ms / calls:>8.3f} | {ms / calls / total:>6.1%} | {n / calls:>8.0f} "
            f"| {name[:width]:<{width}} |"
        )
    rest = ranked[rows:]
    if rest:
        ms, n = sum(r[1][0] for r in rest), sum(r[1][1] for r in rest)
        lines.append(
            f"| {ms / calls:>8.3f} | {ms / calls / total:>6.1%} | {n / calls:>8.0f} | "
            f"{f'({len(rest)} other kernels)':<{width}} |"
        )
    text = "\n".join(lines)
    print(text, flush=True)
    return text


# ---------------------------------------------------------------------------------------- timelines

_GAP_MS = 1.0  # a gap in the GPU's work this long is the host's doing, not a kernel boundary


@dataclasses.dataclass
class Timeline:
    """Where one profiled phase's time went, on the GPU and on the host thread that launched its
    work (`timeline(prof, wall_s)`); printed side by side by `compare_timelines`."""

    wall_ms: float
    busy_ms: float = 0.0  # union of kernel intervals, every stream
    gaps: int = 0  # gaps of >= _GAP_MS between kernels
    gaps_ms: float = 0.0
    streams: dict[int, float] = dataclasses.field(default_factory=dict)  # stream -> kernel ms
    memcpy: dict[str, float] = dataclasses.field(default_factory=dict)  # "DtoH on stream 7" -> ms
    # runtime call -> (calls, ms)
    host: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    # name -> (launches, ms)
    kernels: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    # launching thread's call -> gaps
    hole_owners: dict[str, int] = dataclasses.field(default_factory=dict)
    gil_wake_ms: tuple[float, float, float] | None = (
        None  # GilProbe: median, 99th percentile, longest
    )


def covered(
    spans: list[tuple[int, int]], gap_ms: float = _GAP_MS
) -> tuple[float, list[tuple[int, int]]]:
    """(start ns, end ns) intervals, overlapping or not -> (ms covered by their union, the holes of
    >= gap_ms between them as (start ns, end ns))."""
    busy, holes, end = 0.0, [], None
    for lo, hi in sorted(spans):
        if end is None or lo > end:
            if end is not None and (lo - end) / 1e6 >= gap_ms:
                holes.append((end, lo))
            busy, end = busy + (hi - lo) / 1e6, hi
        elif hi > end:
            busy, end = busy + (hi - end) / 1e6, hi
    return busy, holes


def _hole_owner(hole: tuple[int, int], events: list) -> str:
    """The innermost call of the launching thread that spans at least half of a hole in the GPU's
    work (what the host was doing while the GPU waited), or a note that no profiled call did."""
    lo, hi = hole
    best = None
    for e in events:
        s, t = int(e.time_range.start * 1e3), int(e.time_range.end * 1e3)
        if min(t, hi) - max(s, lo) >= (hi - lo) / 2 and (best is None or t - s < best[0]):
            best = (t - s, e.name)
    return best[1] if best else "(no profiled call: Python between ops)"


def timeline(prof, wall_s: float) -> Timeline:
    """A Timeline from a finished torch.profiler.profile (CPU and CUDA activities). It reads the
    profiler's FunctionEvents (kernels and copies are events of the CUDA device, runtime calls such
    as cudaLaunchKernel or cudaStreamSynchronize are events of the CPU thread that made them)."""
    gpu = _kernel_events(prof)
    copies = [e for e in gpu if e.name.startswith("Memcpy")]
    kernels = [e for e in gpu if not e.name.startswith("Memcpy")]
    out = Timeline(wall_ms=wall_s * 1e3)
    ns = lambda e: (int(e.time_range.start * 1e3), int(e.time_range.end * 1e3))  # noqa: E731  (us -> ns)
    out.busy_ms, holes = covered([ns(e) for e in kernels])
    out.gaps, out.gaps_ms = len(holes), sum(hi - lo for lo, hi in holes) / 1e6
    for e in kernels:
        ms, stream = e.time_range.elapsed_us() / 1e3, getattr(e, "device_resource_id", 0)
        out.streams[stream] = out.streams.get(stream, 0.0) + ms
        n, total = out.kernels.get(e.name, (0, 0.0))
        out.kernels[e.name] = (n + 1, total + ms)
    for e in copies:
        kind = e.name.split(" (")[0].replace("Memcpy ", "")  # "DtoH", "HtoD", "DtoD"
        key = f"{kind} on stream {getattr(e, 'device_resource_id', 0)}"
        out.memcpy[key] = out.memcpy.get(key, 0.0) + e.time_range.elapsed_us() / 1e3
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    runtime = [e for e in cpu if e.name.startswith("cu")]
    launches: dict[int, int] = defaultdict(int)
    for e in runtime:
        launches[e.thread] += "Launch" in e.name
    main = max(launches, key=launches.get) if launches else None
    for e in runtime:
        if e.thread == main:
            n, ms = out.host.get(e.name, (0, 0.0))
            out.host[e.name] = (n + 1, ms + e.time_range.elapsed_us() / 1e3)
    mine = [e for e in cpu if e.thread == main]
    for hole in holes:
        owner = _hole_owner(hole, mine)
        out.hole_owners[owner] = out.hole_owners.get(owner, 0) + 1
    return out


def profile_phase(fn: Callable[[], object], calls: int = 1) -> Timeline:
    """`calls` calls of fn() under torch.profiler (CPU and, on a GPU, CUDA activities) with a
    GilProbe beside them -> their Timeline (totals over the calls)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with (
        profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        ) as prof,
        GilProbe() as probe,
    ):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        wall = time.perf_counter() - started
    out = timeline(prof, wall)
    out.gil_wake_ms = probe.summary_ms()
    return out


def compare_timelines(
    named: list[tuple[str, Timeline]], top_kernels: int = 6, width: int = 34
) -> str:
    """One column per phase: GPU busy and idle, gaps, streams, copies, the launching thread's
    runtime calls, the GIL probe, and the mean time of the largest kernels (a kernel slower in one
    phase than in another ran beside something that took its memory bandwidth or SMs)."""
    names = [n for n, _ in named]
    col = max(14, *(len(n) for n in names))
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, values) -> None:
        rows.append((label, list(values)))

    tls = [t for _, t in named]
    row("wall ms", (f"{t.wall_ms:,.1f}" for t in tls))
    row(
        "GPU busy ms (share of wall)",
        (f"{t.busy_ms:,.1f} ({t.busy_ms / t.wall_ms:.1%})" for t in tls),
    )
    row(f"gaps >= {_GAP_MS:g} ms: count, ms", (f"{t.gaps}, {t.gaps_ms:,.1f}" for t in tls))
    busiest = [max(t.streams.values(), default=0.0) for t in tls]
    row("kernel ms, busiest stream", (f"{ms:,.1f}" for ms in busiest))
    row(
        "kernel ms, other streams",
        (f"{sum(t.streams.values()) - ms:,.1f}" for t, ms in zip(tls, busiest)),
    )
    for key in sorted({k for t in tls for k in t.memcpy}):
        row(f"memcpy {key} ms", (f"{t.memcpy.get(key, 0.0):,.1f}" for t in tls))
    host_calls = sorted(
        {k for t in tls for k, (n, ms) in t.host.items() if ms >= 1.0 or "Sync" in k}
    )
    for key in host_calls:
        row(
            f"host {key}: calls, ms",
            (f"{t.host.get(key, (0, 0.0))[0]}, {t.host.get(key, (0, 0.0))[1]:,.1f}" for t in tls),
        )
    for owner in sorted(
        {k for t in tls for k in t.hole_owners},
        key=lambda k: -max(t.hole_owners.get(k, 0) for t in tls),
    )[:4]:
        row(
            f"gaps while the host ran {owner[:width]}",
            (f"{t.hole_owners.get(owner, 0)}" for t in tls),
        )
    row(
        "GIL wake-up delay ms: median, p99, max",
        (
            "—" if t.gil_wake_ms is None else ", ".join(f"{x:.2f}" for x in t.gil_wake_ms)
            for t in tls
        ),
    )
    first = tls[0]
    for name, (n, ms) in sorted(first.kernels.items(), key=lambda kv: -kv[1][1])[:top_kernels]:
        values = []
        for t in tls:
            m, total = t.kernels.get(name, (0, 0.0))
            values.append(f"{total / m * 1e3:,.0f} us x {m}" if m else "—")
        row(f"mean {name[:width]}", values)
    label_w = max(len(label) for label, _ in rows)
    lines = [
        f"| {'':<{label_w}} | " + " | ".join(f"{n:>{col}}" for n in names) + " |",
        f"|{'-' * (label_w + 2)}|" + "|".join("-" * (col + 2) for _ in names) + "|",
    ]
    lines += [
        f"| {label:<{label_w}} | " + " | ".join(f"{v:>{col}}" for v in values) + " |"
        for label, values in rows
    ]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


class GilProbe:
    """A thread that sleeps 1 ms at a time and measures how much later than asked it runs again: the
    wait for the GIL (plus the OS's wake-up, ~0.1 ms). Other threads holding the GIL show up here
    as they do in the launching thread, which waits the same way before every CUDA call."""

    def __init__(self, period_s: float = 1e-3):
        self.period_s = period_s
        self.delays: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            time.sleep(self.period_s)
            self.delays.append(time.perf_counter() - started - self.period_s)

    def __enter__(self) -> GilProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary_ms(self) -> tuple[float, float, float] | None:
        if not self.delays:
            return None
        ordered = sorted(self.delays)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return statistics.median(ordered) * 1e3, p99 * 1e3, ordered[-1] * 1e3
