"""`make demo` end to end: every stage through its CLI on the embedded tiny target, and a summary
whose figures come from what the stages wrote and equal the README's (within the tolerances
below)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The figures of the demo's summary, each as (pattern, group, kind).
FIGURES = {
    "answers": (r"generated .* (\d+) answers of the target, ([\d,]+) tokens", 1, "count"),
    "generated_tokens": (r"generated .* (\d+) answers of the target, ([\d,]+) tokens", 2, "tokens"),
    "shards": (r"store .* ([\d,]+) tokens in (\d+) shards", 2, "count"),
    "store_tokens": (r"store .* ([\d,]+) tokens in (\d+) shards", 1, "tokens"),
    "final_ce": (r"final cross-entropy (\d+\.\d+), accuracy (\d+\.\d+)", 1, "loss"),
    "final_accuracy": (r"final cross-entropy (\d+\.\d+), accuracy (\d+\.\d+)", 2, "accuracy"),
    "heldout_ce": (r"held out: cross-entropy (\d+\.\d+), accuracy (\d+\.\d+)", 1, "loss"),
    "heldout_accuracy": (r"held out: cross-entropy (\d+\.\d+), accuracy (\d+\.\d+)", 2, "accuracy"),
    "heldout_tau": (r"held out: .* estimated tau (\d+\.\d+)", 1, "tau"),
    "eval_tau": (r"eval .* tau (\d+\.\d+) \(block 8\)", 1, "tau"),
}
# How far a figure may stray from the README's. The demo is deterministic on a CPU: one machine
# and thread count give the same bits on every run, and the README's figures are those bits. On
# another CPU or thread count the float sums inside each matmul add up in another order, which
# moves the last bits of the target's logits and of every training step; over 280 steps that
# reaches the third decimal of a loss, and it may flip a near-tied argmax: one greedy token of the
# generated answers (a few tokens more or fewer downstream) or one draft of the ~400 eval cycles
# (the mean tau of 8 prompts moves by a few thousandths per flip). The tolerances allow a handful
# of such flips and nothing more: a change in what a stage computes (labels, anchors, loss weights,
# features, the eval loop) moves these figures by tenths; [1, 8], all tau can be, passes anything.
# "tokens" is relative; the counts (prompts, shards) depend on the inputs alone.
TOLERANCE = {"count": 0, "tokens": 0.01, "loss": 0.02, "accuracy": 0.01, "tau": 0.05}


def summary_figures(text: str) -> dict[str, float]:
    """The FIGURES found in a demo summary (the demo's output, or the README's copy of it)."""
    out = {}
    for name, (pattern, group, _) in FIGURES.items():
        found = re.search(pattern, text)
        assert found, f"no {name} in the summary"
        out[name] = float(found.group(group).replace(",", ""))
    return out


def test_the_readme_holds_a_demo_summary():
    readme = summary_figures((ROOT / "README.md").read_text())
    assert readme["answers"] == 384 and readme["shards"] == 24 and 1.0 < readme["eval_tau"] < 8.0


@pytest.mark.slow
def test_demo_runs_every_stage_and_summarises_them(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "dflash_common.demo", f"--out={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    assert "lossless: yes" in text
    got, want = summary_figures(text), summary_figures((ROOT / "README.md").read_text())
    for name, (_, _, kind) in FIGURES.items():
        allowed = TOLERANCE[kind] * (want[name] if kind == "tokens" else 1.0)
        assert abs(got[name] - want[name]) <= allowed, (name, got[name], want[name], allowed)
    for made in (
        "store/zarr.json",
        "train/report.png",
        "train/metrics.jsonl",
        "drafter/config.json",
        "drafter/model.safetensors",
        "eval.json",
    ):
        assert (out / made).is_file(), made
    assert str(out / "train" / "report.png") in text
    # not a terminal (as in CI): no progress-bar frames, and a handful of lines per stage
    lines = done.stdout.count("\n") + done.stderr.count("\n")
    assert "\r" not in done.stdout + done.stderr and lines <= 100, (lines, done.stdout, done.stderr)
