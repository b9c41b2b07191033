"""`make demo` end to end: every stage through its CLI on the embedded tiny target, and a summary whose
figures come from what the stages wrote."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_runs_every_stage_and_summarises_them(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "dflash_common.demo", f"--out={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    assert "lossless: yes" in text
    tokens = int(re.search(r"store .* ([\d,]+) tokens in (\d+) shards", text).group(1).replace(",", ""))
    assert tokens > 10_000
    tau = float(re.search(r"tau (\d+\.\d+) \(block 8\)", text).group(1))
    assert 1.0 <= tau <= 8.0
    for made in ("store/zarr.json", "train/report.png", "train/metrics.jsonl", "drafter/config.json",
                 "drafter/model.safetensors", "eval.json"):
        assert (out / made).is_file(), made
    assert str(out / "train" / "report.png") in text
    # not a terminal (as in CI): no progress-bar frames, and a handful of lines per stage (issue 13: ~900)
    lines = done.stdout.count("\n") + done.stderr.count("\n")
    assert "\r" not in done.stdout + done.stderr and lines <= 100, (lines, done.stdout, done.stderr)
