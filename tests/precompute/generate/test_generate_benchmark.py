"""benchmarks/generate.py --quick runs end to end and prints its table (a smoke test; figures are
measured on an H200, not judged here)."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_generate_benchmark_quick(capsys):
    bench = runpy.run_path(str(ROOT / "benchmarks" / "generate.py"), run_name="benchmark")
    bench["main"](["--quick"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("tiny ")]
    assert len(rows) == 1 and len(rows[0].split("|")) == 10
    cells = [c.strip() for c in rows[0].split("|")]
    # no CUDA graphs (c) nor compiled graphs (d) on a CPU; (b)/(a) measured
    assert cells[3] == cells[4] == "n/a" and float(cells[5]) > 0 and cells[6] == cells[7] == "n/a"
    median, spread = cells[1].split(" [")
    lo, hi = (float(x.replace(",", "")) for x in spread.rstrip("]").split("-"))
    assert lo <= float(median.replace(",", "")) <= hi and "median of 2 interleaved runs" in out
    assert "best/roofline" in out and "roofline at 4.8 TB/s" in out


def test_decode_attention_benchmark_quick(capsys):
    """benchmarks/decode_attention.py --quick: every SDPA way that runs on a CPU gives the
    two-matmul reference's values, and its time lies inside its own spread."""
    bench = runpy.run_path(str(ROOT / "benchmarks" / "decode_attention.py"), run_name="benchmark")
    bench["main"](["--quick"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|    64 |")]
    timed = [r for r in rows if "max err" in r]
    assert {r.split("|")[2].strip() for r in timed} >= {"default", "math", "matmuls"}
    for r in timed:
        assert float(r.rsplit("max err", 1)[1]) < 1e-4
        median, spread = r.split("|")[3].strip().split(" [")
        lo, hi = (float(x.replace(",", "")) for x in spread.rstrip("]").split("-"))
        assert lo <= float(median.replace(",", "")) <= hi
