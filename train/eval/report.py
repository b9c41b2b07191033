"""The report of a `dflash-eval` run as people and files read it: the table printed at its end (and
at the end of `--offline`), the failed lossless check in one sentence, the JSON file with its run
record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from dflash_common.cli import run_record, write_run_record
from dflash_common.fsutil import atomic_write_text
from train.eval.config import EvalConfig


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or where one ends early); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mismatch_entry(
    prompt: str, prompt_tokens: int, index: int, speculative: Sequence[int], target: Sequence[int]
) -> dict:
    """The report's record of a prompt whose speculative output first differs from the target's
    at new token `index` (`first_mismatch`); a side that ended before it has None there."""
    at = lambda tokens: tokens[index] if index < len(tokens) else None  # noqa: E731
    return {
        "prompt": prompt,
        "new_token_index": index,
        "position": prompt_tokens + index,
        "speculative": at(speculative),
        "target": at(target),
    }


def lossless_message(report: dict) -> str | None:
    """One sentence naming the first prompt and position where speculative and target output
    differ."""
    bad = report["lossless"]["mismatches"]
    if not bad:
        return None
    m = bad[0]
    more = f" ({len(bad)} prompts differ; all are in the report)" if len(bad) > 1 else ""
    return (
        f"lossless check failed: prompt {m['prompt']} differs at new token {m['new_token_index']} "
        f"(sequence position {m['position']}): speculative {m['speculative']} vs target "
        f"{m['target']}{more}."
    )


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _batch_words(batch_size: int) -> str:
    if batch_size == 1:
        return "batch 1"
    return f"batches of up to {batch_size} prompts, tokens/s per prompt"


def format_report(report: dict) -> str:
    """The readable table printed at the end of a run."""
    s = report["sampling"]
    mode = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}"
    lossless = report["lossless"]
    verdict = (
        "not checked"
        if not lossless["checked"]
        else "ok (identical to the target's greedy output)"
        if lossless["ok"]
        else f"FAILED on {len(lossless['mismatches'])} prompt(s)"
    )
    engine = f", through {report['engine']}" if report.get("engine") else ""
    lines = [
        f"dflash-eval: {report['num_prompts']} prompts, block size {report['block_size']}, "
        f"{mode}{engine}",
        f"  {'tau (acceptance length)':<28}{_fmt(report['tau'], '.3f')}  "
        "(per prompt, then over prompts)",
        f"  {'tau, pooled over cycles':<28}{_fmt(report.get('tau_pooled'), '.3f')}  "
        "(1 + accepted / drafts)",
        f"  {'tau, cycles cut at the end':<28}{_fmt(report.get('tau_emitted'), '.3f')}  "
        "(as path tau replays it)",
        f"  {'draft-verify cycles':<28}{report['num_cycles']}",
        f"  {'new tokens':<28}{report['new_tokens']}",
        f"  {'tokens/s, speculative':<28}{_fmt(report['spec_tokens_per_s'], '.1f')}",
        f"  {'tokens/s, target alone':<28}{_fmt(report['target_tokens_per_s'], '.1f')}",
        f"  {'speedup':<28}{_fmt(report['speedup'], '.2f')}"
        + (
            ""
            if report["speedup"] is None
            else "x (tokens/s speculative / target alone: same "
            "engine, " + _batch_words(report.get("batch_size", 1)) + ", decode after the prefill)"
        ),
        f"  {'lossless':<28}{verdict}",
    ]
    if report["num_prompts_without_cycles"]:
        lines.append(
            f"  ({report['num_prompts_without_cycles']} prompt(s) stopped at their first token: no "
            "tau)"
        )
    lines.append("  acceptance length histogram (tokens per cycle: share of cycles)")
    for n, share in report["histogram"].items():
        lines.append(f"    {n:>3}  {share * 100:5.1f}%  {'#' * round(share * 40)}")
    return "\n".join(lines)


def write_report(report: dict, path: str, cfg: EvalConfig) -> None:
    """The JSON report, with the run record inside and beside it (`<stem>.run.toml/json`)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({**report, "run": run_record(cfg)}, indent=2, default=str))
    write_run_record(out.parent, cfg, name=f"{out.stem}.run")


def format_offline(report: dict) -> str:
    lines = [
        f"dflash-eval --offline: {report['sequences']} held-out sequences, {report['blocks']} "
        f"blocks, block size {report['block_size']}",
        f"  {'tau (estimated)':<28}{_fmt(report['tau'], '.3f')}",
        f"  {'path tau (replayed)':<28}{_fmt(report.get('path_tau'), '.3f')}   pooled "
        f"{_fmt(report.get('path_tau_pooled'), '.3f')}, {report.get('path_cycles', 0)} cycles of "
        f"{report.get('path_sequences', 0)} responses (greedy decoding replayed; exact on "
        "target-greedy data)",
        f"  {'accuracy':<28}{_fmt(report['acc'], '.4f')}",
        f"  {'loss':<28}{_fmt(report['loss'], '.4f')}   gamma-weighted",
        f"  {'cross-entropy':<28}{_fmt(report.get('ce'), '.4f')}   every block position alike "
        "(as the trainer's ce)",
        "  accuracy by block position (k = 1 predicts the token after the anchor)",
    ]
    lines += [
        f"    {k:>3}  {acc * 100:5.1f}%" for k, acc in enumerate(report["acc_by_pos"], start=1)
    ]
    return "\n".join(lines)
