"""benchmarks/precompute.py --quick runs end to end and prints its table (a smoke test; figures are
not judged here, they are measured on an H200)."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_precompute_benchmark_quick(tmp_path, capsys):
    bench = runpy.run_path(str(ROOT / "benchmarks" / "precompute.py"), run_name="benchmark")
    bench["main"](["--quick", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("(a)") or line.startswith("(b)")]
    assert [r.split("|")[0].strip() for r in rows] == [
        "(a) HF forward, output_hidden_states, states on GPU",
        "(b) dflash-precompute -> store, bf16",
        "(b) dflash-precompute -> store, fp8_e4m3",
    ]
    assert all(
        int(r.split("|")[1].replace(",", "")) == int(rows[0].split("|")[1].replace(",", ""))
        for r in rows
    )
    assert "disk write, fsynced, 1 stream(s)" in out and "store write during (b), fp8_e4m3" in out
    assert "median of 2 interleaved repeats" in out and "repeat 2 of 2" in out
    lo, hi = (float(x.replace(",", "")) for x in rows[1].split("|")[4].strip().split("-"))
    assert (
        lo <= float(rows[1].split("|")[3].replace(",", "")) <= hi
    )  # the median lies in the spread
    assert list(tmp_path.iterdir()) == []  # it cleans up after itself


def test_precompute_benchmark_profile_prints_the_rows_side_by_side(tmp_path, capsys):
    bench = runpy.run_path(str(ROOT / "benchmarks" / "precompute.py"), run_name="benchmark")
    bench["main"](["--quick", "--dir", str(tmp_path), "--dtypes", "bf16", "--profile"])
    out = capsys.readouterr().out
    table = out[out.index("profile: one more run") :].splitlines()[1:]
    assert [c.strip() for c in table[0].strip("|").split("|")][1:] == ["(a)", "(b) bf16"]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
        for line in table[2:]
    }
    assert (
        float(rows["wall ms"][0].replace(",", "")) > 0
        and float(rows["wall ms"][1].replace(",", "")) > 0
    )
    median, p99, longest = (
        float(x) for x in rows["GIL wake-up delay ms: median, p99, max"][1].split(",")
    )
    assert 0 <= median <= p99 <= longest  # the probe ran beside (b)'s forward loop
    assert list(tmp_path.iterdir()) == []
