"""benchmarks/loss.py and benchmarks/soft_loss.py run (--quick, CPU, torch backend) and print one
timed row per loss and size: soft_loss.py builds on loss.py's helpers, so a change to them that
breaks it fails here rather than on a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# a timed row: label | N, H, V | median ms | lowest-highest ms | ...
TIMED = re.compile(
    r"^\| (?P<label>[^|]+?) +\| (?P<size>\d+, \d+, \d+) +\|"
    r" +(?P<ms>[\d.]+) \| +(?P<lo>[\d.]+)-(?P<hi>[\d.]+) \|"
)


def _run(script: str) -> list[re.Match]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # torch rows only: fast
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return [m for line in out.stdout.splitlines() if (m := TIMED.match(line))]


@pytest.mark.parametrize(
    "script, labels",
    [
        (
            "loss.py",
            [
                "dflash fused [torch], all rows weighted",
                "dflash fused [torch], block weights (1/16 skipped)",
                "plain PyTorch (logits + F.cross_entropy)",
            ],
        ),
        (
            "soft_loss.py",
            ["hard CE (fused_lm_head_loss)", "soft ce", "soft kl", "soft tv", "soft dspark"],
        ),
    ],
)
def test_loss_benchmarks_print_median_and_spread_for_every_row(script, labels):
    rows = _run(script)
    assert [m["label"] for m in rows] == labels * 2  # both quick sizes, in order
    assert len({m["size"] for m in rows}) == 2
    for m in rows:
        assert float(m["lo"]) <= float(m["ms"]) <= float(m["hi"]) and float(m["ms"]) > 0


def test_loss_precision_table_has_both_kinds_of_rows():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # torch's row only: fast
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "benchmarks/loss.py", "--precision"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    row = re.compile(
        r"^\| (typical|confident) +\| torch +\| +([\d.e+-]+) \| +([\d.e+-]+) \| +([\d.e+-]+) \|$"
    )
    found = {
        m[1]: [float(x) for x in m.groups()[1:]]
        for line in out.stdout.splitlines()
        if (m := row.match(line))
    }
    assert set(found) == {"typical", "confident"}
    # exact's bf16 softmax - 1 on near-certain rows
    assert found["typical"][0] < 2e-2 < found["confident"][0]
