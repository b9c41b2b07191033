"""dflash-generate's vllm backend (`make serve-check`, in .venv-vllm): vLLM's CPU build answers the
same prompts with the same greedy tokens as the transformers backend, in float32, through the same
CLI, and writes an output dflash-precompute reads. Skipped where vLLM is not importable (the main
.venv).

The tiny target has head_dim 64 (vLLM's CPU attention refuses 16) and weights large enough (init
0.05) that its greedy choices are not near-ties a change of kernel could flip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train.eval.vllm_engine import ENV, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not importable here"),
]

ROOT = Path(__file__).resolve().parents[3]
SPEC = dict(
    num_layers=4,
    hidden_size=128,
    intermediate_size=256,
    num_heads=2,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=500.0,
    initializer_range=0.05,
)
PROMPTS = [
    "def add(a, b):",
    "hello there",
    "The quick brown fox",
    "0 1 2 3 4",
    "import os",
    "Once upon a time",
]


def _generate(target: Path, prompts: Path, out: Path, backend: str) -> list[dict]:
    env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "precompute.generate.cli",
            f"--target.path={target}",
            "--target.dtype=fp32",
            f"--data.inputs=['{prompts}']",
            "--sampling.temperature=0",
            "--sampling.max_new_tokens=24",
            f"--generate.backend={backend}",
            f"--output.dir={out}",
            "--run.device=cpu",
            "--run.progress=false",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{backend}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    records = [
        json.loads(line)
        for f in sorted(out.glob("u*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    return sorted(records, key=lambda r: r["source"])


def test_vllm_backend_gives_the_transformers_backends_greedy_answers(tmp_path):
    from dflash_common.tiny import TinySpec, build_tiny_target

    target = build_tiny_target(tmp_path / "target", TinySpec(**SPEC))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    ours = _generate(target, prompts, tmp_path / "hf", "transformers")
    theirs = _generate(target, prompts, tmp_path / "vllm", "vllm")
    assert len(ours) == len(PROMPTS) and [r["source"] for r in theirs] == [
        r["source"] for r in ours
    ]
    for a, b in zip(ours, theirs):
        assert b["messages"] == a["messages"], a["source"]
        assert b["finish_reason"] == a["finish_reason"], a["source"]
        assert b["answer_ids"] == a["answer_ids"], a["source"]  # the stop token, where it stopped
    assert any(r["messages"][-1]["content"] for r in ours)  # something was answered
    manifest = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert manifest["settings"]["generate"]["backend"] == "vllm"
