"""What every benchmark reports of its repeats: the median, and the spread (lowest-highest)
beside it.

On a shared machine one run is noise, so a figure without its spread cannot be compared with
another. `Spread.of(xs)` summarises repeats; `.per(numerator)` turns seconds into a rate (the
slowest repeat gives the lowest rate); `.text()` writes "median [lowest-highest]".
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, xs: list[float]) -> Spread:
        if not xs:
            raise ValueError("no repeats to summarise")
        return cls(statistics.median(xs), min(xs), max(xs))

    def scaled(self, k: float) -> Spread:
        """Every figure times k (k > 0): seconds -> ms with k=1e3."""
        return Spread(self.median * k, self.low * k, self.high * k)

    def per(self, numerator: float) -> Spread:
        """numerator / x of every figure: tokens over seconds -> tok/s. The median of the rates is
        the rate of the median time (odd counts; the mean of the middle two for even ones)."""
        rates = sorted(numerator / x for x in (self.low, self.median, self.high))
        return Spread(numerator / self.median, rates[0], rates[-1])

    def text(self, fmt: str = ".1f") -> str:
        return f"{self.median:{fmt}} [{self.low:{fmt}}-{self.high:{fmt}}]"


def wall_times(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 0,
    cuda: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Seconds of each of `repeats` calls of fn after `warmup` untimed ones; with cuda, each call is
    synchronised alone (the GPU starts idle and the timing ends when its work does). `clock`
    time.process_time counts this process's CPU seconds instead (all its threads): on a shared
    CPU, what other jobs do not inflate."""
    times = []
    for i in range(warmup + repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(clock() - t0)
    return times


def cuda_ms(fn: Callable[[], object]) -> tuple[float, object]:
    """(milliseconds on the GPU, fn's result) of one call of fn between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), out
