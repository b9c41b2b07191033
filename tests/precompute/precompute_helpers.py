"""Helpers shared by the precompute tests: small JSONL inputs and configs on the tiny targets."""

from __future__ import annotations

import json

from dflash_common.config import load_config
from dflash_common.precompute_config import PrecomputeConfig


def chat(i: int, answer_len: int = 40) -> dict:
    """A conversation whose answer has `answer_len` + 1 response tokens (byte tokenizer + <|im_end|>)."""
    answer = (f"answer {i} " * 40)[:answer_len]
    return {"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": answer}]}


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def make_config(target, inputs, store, *overrides: str) -> PrecomputeConfig:
    """A config on `target` with small units and lengths; `overrides` are 'section.field=value'."""
    args = [f"--target.path={json.dumps(str(target))}", f"--data.inputs={json.dumps(list(inputs))}",
            f"--store.path={json.dumps(str(store))}", "--data.block_size=4", "--data.max_length=256",
            "--batching.token_budget=1024", "--run.samples_per_unit=4", "--target.dtype=fp32",
            "--run.device=cpu"]
    return load_config(PrecomputeConfig, None, args + [f"--{o}" for o in overrides])
