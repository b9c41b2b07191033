"""benchmarks/timing.py summarises repeats as median [lowest-highest]; the benchmarks that time
repeated steps on the CPU (--quick) print that for every row."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.timing import Spread, wall_times

ROOT = Path(__file__).resolve().parents[2]
CELL = re.compile(r"(?P<median>[\d,.]+) \[(?P<low>[\d,.]+)-(?P<high>[\d,.]+)\]")


def test_spread_of_repeats_and_its_rate():
    s = Spread.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.low, s.high) == (2.5, 1.0, 10.0)
    assert s.scaled(1e3) == Spread(2500.0, 1000.0, 10000.0)
    # 8 tokens over seconds: the slowest repeat is the lowest rate
    rate = Spread.of([2.0, 4.0, 8.0]).per(8.0)
    assert (rate.median, rate.low, rate.high) == (2.0, 1.0, 4.0)
    assert Spread(1234.5, 1000.0, 1500.25).text(",.0f") == "1,234 [1,000-1,500]"
    with pytest.raises(ValueError, match="no repeats"):
        Spread.of([])


def test_wall_times_skips_the_warmup_calls():
    calls = []
    times = wall_times(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(times) == 3 and len(calls) == 5 and all(t >= 0 for t in times)


@pytest.mark.parametrize(
    "script, rows",
    [
        ("levers.py", 10),  # the recipe and the nine variants of levers.VARIANTS
        ("levers.py --dspark", 6),  # the recipe, D-PACE and the four DSpark variants
        ("levers.py --dflash2", 6),  # the recipe, D-PACE and the four DFlash2 variants
        ("drafter_step.py", 0),  # its own columns: ms, then lowest-highest
        ("precompute_batching.py", 4),  # four batch layouts
        ("eval_batched.py", 2),  # batched and one at a time
    ],
)
def test_step_benchmarks_print_median_and_spread(script, rows):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, *f"benchmarks/{script}".split(), "--quick"]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cells = [m for line in out.stdout.splitlines() if (m := CELL.search(line))]
    assert len(cells) == rows
    for m in cells:
        low, median, high = (float(m[k].replace(",", "")) for k in ("low", "median", "high"))
        assert 0 < low <= median <= high
    if script == "drafter_step.py":  # | variant | ms / step | lowest-highest | ...
        spread = re.compile(
            r"^\| eager(, synced)? +\| +(?P<ms>[\d.]+) \| +(?P<lo>[\d.]+)-(?P<hi>[\d.]+) \|"
        )
        found = [m for line in out.stdout.splitlines() if (m := spread.match(line))]
        assert len(found) == 2 and all(
            float(m["lo"]) <= float(m["ms"]) <= float(m["hi"]) for m in found
        )
