"""benchmarks/store_io.py --quick runs and prints its table (a smoke test; figures are not
judged)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_store_io_benchmark_quick(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/store_io.py"), "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rows = [
        line
        for line in r.stdout.splitlines()
        if line.startswith("| bf16") or line.startswith("| fp8")
    ]
    assert len(rows) == 6  # 2 dtypes x 3 codecs
    assert list(tmp_path.iterdir()) == []  # it cleans up after itself
