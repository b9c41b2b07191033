"""`dflash-eval`: a drafter's acceptance length tau by real speculative decoding on the user's target,
with the lossless check, tokens/s with and without the drafter, and the speedup.

    dflash-eval --config configs/eval-qwen3-8b.toml --drafter runs/x/export [--report eval.json]

tau is measured as the DFlash authors' loop does (z-lab/dflash `dflash/model.py`, `spec_generate`; see
TAU_DEFINITION, which the report carries): each draft-verify cycle drafts a whole block and counts
accepted drafts + 1, uncut, even past the length limit or a stop token; the prefill's token is not
counted; per prompt the mean over its cycles, then the mean over prompts. Beside it the pooled figure
engines log, 1 + accepted / drafts over all cycles (`tau_pooled`), and `tau_emitted`: the same mean
over the tokens each cycle adds to the output cut at the limit and the stop token (only the last cycle
of a response differs; path tau, train/path_tau.py, reproduces it exactly from a store).
Throughput also follows the reference: time per output token is the decode time (after the prefill)
over the new tokens, averaged over prompts; tokens/s is its inverse; speedup is the ratio of the two.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from dflash_common.cli import (
    UserError, exit_with_error, parse_args, progress_bar, run_record, setup_logging, user_errors_exit,
    write_run_record,
)
from dflash_common.drafter.layer_ids import check_layer_ids
from dflash_common.fsutil import atomic_write_text
from train.eval.baseline_cache import BaselineCache
from train.eval.config import EvalConfig, GenerationSection
from train.eval.spec_decode import (
    Decoded, DFlashProposer, Drafter, Sampling, TargetRunner, speculative_generate, target_generate,
)

log = logging.getLogger("dflash")

TAU_DEFINITION = (
    "tau: per prompt the mean over its draft-verify cycles of (accepted drafts + 1), then the mean over "
    "prompts, counted as the DFlash authors' loop does (z-lab/dflash spec_generate: whole blocks while the "
    "anchor is below the length limit, every cycle uncut, stop after the cycle that emits a stop token); "
    "tau_pooled: 1 + accepted / drafts over all cycles of all prompts, as engines log it (vLLM); "
    "tau_emitted: as tau, but each cycle counts only the tokens it adds to the output cut at the length "
    "limit and after the stop token (cycles adding none dropped), so only the last cycle of a prompt "
    "differs; it is what path tau (dflash-eval --offline) replays exactly."
)


class LosslessError(RuntimeError):
    """Greedy speculative decoding emitted something the target alone would not have."""


@dataclass(frozen=True)
class Prompt:
    """One thing to decode: `ids` ready, or `turns` (user messages, each answered by the speculative
    output before the next, as the reference benchmark does for MT-Bench)."""

    name: str  # file:line, as the user can find it
    ids: list[int] | None = None
    turns: list[str] | None = None


@dataclass
class PromptResult:
    name: str
    prompt_tokens: int
    spec: Decoded
    target: Decoded | None = None
    first_mismatch: int | None = None  # greedy lossless check: first new-token index that differs

    @property
    def tau(self) -> float | None:
        lengths = self.spec.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else None

    @property
    def tau_emitted(self) -> float | None:
        emitted = self.spec.emitted
        return sum(emitted) / len(emitted) if emitted else None


# ---------------------------------------------------------------- prompts

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "chatgpt": "assistant"}


def _messages(record: dict, where: str) -> list[dict] | None:
    """A record's conversation as role/content messages, or None when it is not a conversation."""
    if "messages" in record:
        raw, role_key, content_key, roles = record["messages"], "role", "content", None
    elif "conversations" in record:  # ShareGPT: {"from": "human", "value": "..."}
        raw, role_key, content_key, roles = record["conversations"], "from", "value", _SHAREGPT_ROLES
    else:
        return None
    if not isinstance(raw, list):
        raise UserError(f"{where}: '{'messages' if roles is None else 'conversations'}' must be a list of messages.")
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get(role_key), str) or not isinstance(m.get(content_key), str):
            raise UserError(f"{where}: every message needs a string '{role_key}' and a string '{content_key}'.")
        role = m[role_key] if roles is None else roles.get(m[role_key])
        if role is None:
            raise UserError(f"{where}: unknown ShareGPT role {m[role_key]!r}; use human, gpt or system.")
        out.append({"role": role, "content": m[content_key]})
    return out


def _record_to_prompt(record: Any, where: str, tokenizer, template_kwargs: dict) -> Prompt:
    if not isinstance(record, dict):
        raise UserError(f"{where}: each line must be a JSON object with 'messages', 'conversations', "
                        f"'turns' or 'prompt'.")
    if isinstance(record.get("prompt"), str):
        return Prompt(where, ids=tokenizer.encode(record["prompt"]))
    if isinstance(record.get("turns"), list):
        if not record["turns"] or not all(isinstance(t, str) for t in record["turns"]):
            raise UserError(f"{where}: 'turns' must be a non-empty list of strings (the user's messages).")
        return Prompt(where, turns=list(record["turns"]))
    messages = _messages(record, where)
    if messages is None:
        raise UserError(f"{where}: found none of 'messages', 'conversations', 'turns' or 'prompt'; "
                        f"give each line one of them.")
    while messages and messages[-1]["role"] == "assistant":  # the reply is what we generate
        messages.pop()
    if not messages:
        raise UserError(f"{where}: the conversation has no message before its reply; drop the line.")
    return Prompt(where, ids=render_chat(tokenizer, messages, template_kwargs, where))


def render_chat(tokenizer, messages: list[dict], template_kwargs: dict, where: str = "") -> list[int]:
    """Token ids of `messages` with the target's chat template and the generation prompt."""
    from dflash_common.chat import ChatMaskError, ChatTemplate

    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the target's tokenizer has no chat template; use {'prompt': ...} lines for raw text.")
    try:
        return ChatTemplate(tokenizer, template_kwargs).prompt_ids(messages)
    except ChatMaskError as e:
        raise UserError(
            f"{where or 'a prompt'}: the chat template refused the conversation ({e}); fix the line.") from e


def load_prompts(files: Sequence[str], tokenizer, template_kwargs: dict, limit: int = 0) -> list[Prompt]:
    """Prompts from JSONL files, in file order; `limit` > 0 keeps the first `limit`."""
    if not files:
        raise UserError("no prompts: set prompts.files to one or more JSONL files.")
    prompts = []
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise UserError(f"prompts file {path} does not exist; fix prompts.files.")
        for line_no, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{line_no} is not valid JSON ({e.msg}); fix the line.") from e
            prompts.append(_record_to_prompt(record, f"{path}:{line_no}", tokenizer, template_kwargs))
            if 0 < limit <= len(prompts):
                return prompts
    if not prompts:
        raise UserError(f"prompts files {list(files)} hold no prompt; add JSONL lines.")
    return prompts


# ---------------------------------------------------------------- decoding


@dataclass(frozen=True)
class Settings:
    """How every prompt is decoded (resolved from the config and the drafter)."""

    block_size: int
    max_new_tokens: int
    sampling: Sampling
    stop_ids: frozenset[int]
    seed: int
    baseline: bool  # also decode with the target alone
    check_lossless: bool  # greedy, with a baseline to compare against
    baseline_cache: BaselineCache | None = None  # the target-alone decodes of earlier evaluations


def settings_from(gen: GenerationSection, check_lossless: str, baseline: bool, block_size: int,
                  stop_ids: frozenset[int]) -> Settings:
    sampling = Sampling(gen.temperature, gen.top_p, gen.top_k)
    return Settings(
        block_size=gen.block_size or block_size,
        max_new_tokens=gen.max_new_tokens,
        sampling=sampling,
        stop_ids=frozenset() if gen.ignore_eos else stop_ids,
        seed=gen.seed,
        baseline=baseline,
        check_lossless=sampling.greedy and baseline and check_lossless != "off",
    )


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or where one ends early); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def decode_one(target: TargetRunner, drafter: Drafter, name: str, ids: list[int], s: Settings,
               index: int) -> PromptResult:
    """Speculative decoding of one prompt, then (optionally) the target alone, and the comparison."""
    spec = speculative_generate(
        target, drafter, ids, block_size=s.block_size, max_new_tokens=s.max_new_tokens,
        stop_ids=s.stop_ids, sampling=s.sampling, generator=_generator(target.device, s.seed + index),
    )
    base = None
    if s.baseline:
        cache, key = s.baseline_cache, None
        if cache is not None:
            key = cache.key(ids, s.max_new_tokens, s.sampling, s.seed + index, s.stop_ids)
            base = cache.get(key)
        if base is None:
            base = target_generate(
                target, ids, max_new_tokens=s.max_new_tokens, stop_ids=s.stop_ids, sampling=s.sampling,
                generator=_generator(target.device, s.seed + index),
            )
            if cache is not None:
                cache.put(key, base)
    mismatch = first_mismatch(spec.tokens, base.tokens) if s.check_lossless else None
    return PromptResult(name, len(ids), spec, base, mismatch)


def _warm_up(target: TargetRunner, drafter: Drafter, ids: list[int], s: Settings) -> None:
    """One short decode of each kind, untimed: kernels and allocators are set up before the clock runs."""
    short = dataclasses.replace(s, max_new_tokens=min(s.max_new_tokens, 2 * s.block_size))
    decode_one(target, drafter, "warm-up", ids, short, index=0)


def decode_prompts(target: TargetRunner, drafter: Drafter, prompts: Sequence[Prompt], s: Settings, *,
                   tokenizer=None, template_kwargs: dict | None = None, warmup: bool = True) -> list[PromptResult]:
    """Decode every prompt (each turn of a multi-turn prompt is a prompt of its own)."""
    results: list[PromptResult] = []
    for prompt in progress_bar(prompts, enabled=len(prompts) > 1, desc="dflash-eval", unit="prompt"):
        if prompt.ids is not None:
            if warmup and not results:
                _warm_up(target, drafter, prompt.ids, s)
            results.append(decode_one(target, drafter, prompt.name, prompt.ids, s, len(results)))
            continue
        messages: list[dict] = []
        for turn, text in enumerate(prompt.turns):
            messages.append({"role": "user", "content": text})
            ids = render_chat(tokenizer, messages, template_kwargs or {}, prompt.name)
            if warmup and not results:
                _warm_up(target, drafter, ids, s)
            result = decode_one(target, drafter, f"{prompt.name}#turn{turn + 1}", ids, s, len(results))
            results.append(result)
            answer = tokenizer.decode(result.spec.tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
    return results


# ---------------------------------------------------------------- report


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize(results: Sequence[PromptResult], s: Settings) -> dict:
    """The numbers of an evaluation (JSON-ready)."""
    taus = [r.tau for r in results if r.tau is not None]
    lengths = [n for r in results for n in r.spec.acceptance_lengths]
    counts = [lengths.count(n) for n in range(1, s.block_size + 1)]
    spec_tpot = _mean([r.spec.time_per_token for r in results])
    base_tpot = _mean([r.target.time_per_token for r in results]) if s.baseline else None
    mismatches = [{"prompt": r.name, "new_token_index": r.first_mismatch,
                   "position": r.prompt_tokens + r.first_mismatch,
                   "speculative": _token_at(r.spec.tokens, r.first_mismatch),
                   "target": _token_at(r.target.tokens, r.first_mismatch)}
                  for r in results if r.first_mismatch is not None]
    return {
        "tau": _mean(taus),
        # the figure engines log (vLLM: 1 + num_accepted_tokens / num_drafts): every cycle weighs the same
        "tau_pooled": _mean(lengths),
        # cycles cut as the output is (path tau's figure): per prompt, then over prompts
        "tau_emitted": _mean([r.tau_emitted for r in results if r.tau_emitted is not None]),
        "tau_definition": TAU_DEFINITION,
        "block_size": s.block_size,
        "num_prompts": len(results),
        "num_prompts_without_cycles": len(results) - len(taus),
        "num_cycles": len(lengths),
        "new_tokens": sum(len(r.spec.tokens) for r in results),
        # histogram[k]: share of cycles that emitted k tokens (k-1 accepted drafts + the target's own)
        "histogram": {str(n): c / len(lengths) if lengths else 0.0 for n, c in zip(range(1, s.block_size + 1), counts)},
        "histogram_counts": {str(n): c for n, c in zip(range(1, s.block_size + 1), counts)},
        "spec_tokens_per_s": 1 / spec_tpot if spec_tpot else None,
        "target_tokens_per_s": 1 / base_tpot if base_tpot else None,
        "speedup": base_tpot / spec_tpot if base_tpot and spec_tpot else None,
        "sampling": {"temperature": s.sampling.temperature, "top_p": s.sampling.top_p, "top_k": s.sampling.top_k},
        "lossless": {"checked": s.check_lossless, "ok": not mismatches if s.check_lossless else None,
                     "mismatches": mismatches},
        "prompts": [_prompt_entry(r) for r in results],
    }


def _token_at(tokens: Sequence[int], i: int) -> int | None:
    return tokens[i] if i < len(tokens) else None


def _prompt_entry(r: PromptResult) -> dict:
    entry = {"name": r.name, "prompt_tokens": r.prompt_tokens, "new_tokens": len(r.spec.tokens), "tau": r.tau,
             "acceptance_lengths": r.spec.acceptance_lengths, "emitted": r.spec.emitted,
             "spec_decode_s": r.spec.decode_s}
    if r.target is not None:
        entry["target_decode_s"] = r.target.decode_s
    return entry


def lossless_message(report: dict) -> str | None:
    """One sentence naming the first prompt and position where speculative and target output differ."""
    bad = report["lossless"]["mismatches"]
    if not bad:
        return None
    m = bad[0]
    more = f" ({len(bad)} prompts differ; all are in the report)" if len(bad) > 1 else ""
    return (f"lossless check failed: prompt {m['prompt']} differs at new token {m['new_token_index']} "
            f"(sequence position {m['position']}): speculative {m['speculative']} vs target {m['target']}{more}.")


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def format_report(report: dict) -> str:
    """The readable table printed at the end of a run."""
    s = report["sampling"]
    mode = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}"
    lossless = report["lossless"]
    verdict = ("not checked" if not lossless["checked"] else
               "ok (identical to the target's greedy output)" if lossless["ok"] else
               f"FAILED on {len(lossless['mismatches'])} prompt(s)")
    engine = f", through {report['engine']}" if report.get("engine") else ""
    lines = [
        f"dflash-eval: {report['num_prompts']} prompts, block size {report['block_size']}, {mode}{engine}",
        f"  {'tau (acceptance length)':<28}{_fmt(report['tau'], '.3f')}  (per prompt, then over prompts)",
        f"  {'tau, pooled over cycles':<28}{_fmt(report.get('tau_pooled'), '.3f')}  (1 + accepted / drafts)",
        f"  {'tau, cycles cut at the end':<28}{_fmt(report.get('tau_emitted'), '.3f')}  (as path tau replays it)",
        f"  {'draft-verify cycles':<28}{report['num_cycles']}",
        f"  {'new tokens':<28}{report['new_tokens']}",
        f"  {'tokens/s, speculative':<28}{_fmt(report['spec_tokens_per_s'], '.1f')}",
        f"  {'tokens/s, target alone':<28}{_fmt(report['target_tokens_per_s'], '.1f')}",
        f"  {'speedup':<28}{_fmt(report['speedup'], '.2f')}"
        + ("" if report["speedup"] is None else "x (tokens/s speculative / target alone: same engine, batch 1, "
           "decode after the prefill)"),
        f"  {'lossless':<28}{verdict}",
    ]
    if report["num_prompts_without_cycles"]:
        lines.append(f"  ({report['num_prompts_without_cycles']} prompt(s) stopped at their first token: no tau)")
    lines.append("  acceptance length histogram (tokens per cycle: share of cycles)")
    for n, share in report["histogram"].items():
        lines.append(f"    {n:>3}  {share * 100:5.1f}%  {'#' * round(share * 40)}")
    return "\n".join(lines)


# ---------------------------------------------------------------- run

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"target.device = {name!r} but no CUDA GPU is visible; use 'auto' or 'cpu'.")
    return device


def load_target(path: str, dtype: str, device: str, attn_implementation: str):
    """The target causal LM, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    _check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], attn_implementation=attn_implementation)
    return model.to(resolve_device(device)).eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    _check_model_dir(path)
    return AutoTokenizer.from_pretrained(path)


def _check_model_dir(path: str) -> None:
    if not path or not (Path(path) / "config.json").is_file():
        raise UserError(f"target.path {path!r} is not a model directory (no config.json); set --target.path=DIR.")


def load_dflash(path: str, target_config, device: torch.device, dtype: torch.dtype):
    """The exported drafter at `path`, refused in one sentence unless it was made for this target."""
    from dflash_common.drafter.export import load_drafter

    if not path:
        raise UserError("no drafter: pass --drafter DIR (an exported drafter, a step-N checkpoint or a run directory).")
    drafter, dcfg = load_drafter(path, device=device, dtype=dtype)
    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    wants = {"hidden_size": t.hidden_size, "vocab_size": t.vocab_size, "num_target_layers": t.num_hidden_layers}
    bad = [f"{k} {getattr(dcfg, k)} vs the target's {v}" for k, v in wants.items() if getattr(dcfg, k) != v]
    if bad:
        raise UserError(
            f"drafter {path} was made for another target ({'; '.join(bad)}); evaluate it on its own target.")
    return drafter.eval()


def attach_target(drafter, model) -> DFlashProposer:
    """The drafter behind the engine's protocol, with the loaded target's embedding and lm_head
    attached (shared, not read again)."""
    drafter.attach_frozen(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return DFlashProposer(drafter)


def load_proposer(path: str, model) -> DFlashProposer:
    """The exported drafter at `path` on the target's device and dtype, ready to propose."""
    weight = next(model.parameters())
    return attach_target(load_dflash(path, model.config, weight.device, weight.dtype), model)


def stop_token_ids(model, tokenizer) -> frozenset[int]:
    """End-of-sequence ids of the generation config and the tokenizer (Qwen3 chat ends at <|im_end|>)."""
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return frozenset(ids)


def evaluate_drafter(model, tokenizer, drafter: Drafter, cfg: EvalConfig, prompts: Sequence[Prompt]) -> dict:
    """Decode `prompts` with `drafter` against `model`; the JSON-ready report (see `summarize`)."""
    num_layers = model.config.num_hidden_layers
    try:
        check_layer_ids(list(drafter.layer_ids), num_layers)
    except ValueError as e:
        raise UserError(
            f"the drafter does not fit this target: {e}; evaluate it on the target it was trained for.") from e
    s = settings_from(cfg.generation, cfg.check.lossless, cfg.check.baseline, drafter.block_size,
                      stop_token_ids(model, tokenizer))
    target = TargetRunner(model, drafter.layer_ids)
    if cfg.check.baseline and cfg.check.baseline_cache:
        s = dataclasses.replace(s, baseline_cache=BaselineCache.open(
            cfg.check.baseline_cache, cfg.target.path, cfg.target.dtype, str(target.device)))
    results = decode_prompts(target, drafter, prompts, s, tokenizer=tokenizer,
                             template_kwargs=cfg.prompts.chat_template_kwargs, warmup=cfg.generation.warmup)
    report = summarize(results, s)
    report["dtype"] = cfg.target.dtype
    report["device"] = str(target.device)
    return report


def write_report(report: dict, path: str, cfg: EvalConfig) -> None:
    """The JSON report, with the run record inside and beside it (`<stem>.run.toml/json`)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({**report, "run": run_record(cfg)}, indent=2, default=str))
    write_run_record(out.parent, cfg, name=f"{out.stem}.run")


def run(cfg: EvalConfig) -> dict:
    """Load the target and the drafter, decode every prompt, write and print the report; a failed
    lossless check raises `LosslessError` after the report is written (`check.lossless = 'error'`)."""
    if cfg.target.engine == "vllm":
        return finish(run_vllm(cfg), cfg)
    tokenizer = load_tokenizer(cfg.target.path)  # prompts are checked before the model is loaded
    prompts = load_prompts(cfg.prompts.files, tokenizer, cfg.prompts.chat_template_kwargs, cfg.prompts.num_prompts)
    # the drafter first: one that does not fit is refused before a large target is loaded
    from transformers import AutoConfig

    drafter = load_dflash(cfg.drafter.path, AutoConfig.from_pretrained(cfg.target.path),
                          resolve_device(cfg.target.device), _DTYPES[cfg.target.dtype])
    model = load_target(cfg.target.path, cfg.target.dtype, cfg.target.device, cfg.target.attn_implementation)
    proposer = attach_target(drafter, model)
    log.info("evaluating %s on %s: %d prompts, block size %d", cfg.drafter.path, cfg.target.path, len(prompts),
             cfg.generation.block_size or proposer.block_size)
    report = evaluate_drafter(model, tokenizer, proposer, cfg, prompts)
    return finish(report, cfg)


def finish(report: dict, cfg: EvalConfig) -> dict:
    """Write and print the report; raise `LosslessError` on a failed check (`check.lossless = 'error'`)."""
    report["drafter"] = cfg.drafter.path
    report["target"] = cfg.target.path
    if cfg.report.path:
        write_report(report, cfg.report.path, cfg)
        log.info("report written to %s", cfg.report.path)
    print(format_report(report))
    message = lossless_message(report)
    if message and cfg.check.lossless == "error":
        raise LosslessError(message)
    if message:
        log.warning("%s", message)
    return report


# ---------------------------------------------------------------- through vLLM


def run_vllm(cfg: EvalConfig) -> dict:
    """The report measured through vLLM (train/eval/vllm_engine.py): the exported drafter served with its
    target, and the target served alone for the lossless check and the baseline."""
    import tempfile
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    from dflash_common.drafter.export import resolve_drafter_dir
    from train.eval import vllm_engine

    if not vllm_engine.vllm_available():
        raise UserError("--engine vllm needs vLLM importable here; run it from .venv-vllm (make serve-check "
                        "builds it) or use --engine transformers.")
    if cfg.generation.temperature != 0 or cfg.target.dtype != "float32":
        raise UserError("--engine vllm measures greedy float32 decoding; set generation.temperature = 0 and "
                        "target.dtype = 'float32'.")
    tokenizer = load_tokenizer(cfg.target.path)
    prompts = load_prompts(cfg.prompts.files, tokenizer, cfg.prompts.chat_template_kwargs, cfg.prompts.num_prompts)
    if any(p.ids is None for p in prompts):
        raise UserError("--engine vllm takes single-turn prompts; drop the 'turns' lines or use --engine transformers.")
    drafter = load_dflash(cfg.drafter.path, AutoConfig.from_pretrained(cfg.target.path), torch.device("cpu"),
                          torch.float32)  # refused here, in one sentence, unless made for this target
    block = cfg.generation.block_size or drafter.cfg.block_size
    try:
        generation = GenerationConfig.from_pretrained(cfg.target.path)
    except OSError:
        generation = None
    stops = [] if cfg.generation.ignore_eos else sorted(stop_token_ids(SimpleNamespace(generation_config=generation),
                                                                       tokenizer))
    request = {"target": str(Path(cfg.target.path).resolve()), "prompts": [p.ids for p in prompts],
               "max_new_tokens": cfg.generation.max_new_tokens, "stop_ids": stops,
               "max_model_len": max(len(p.ids) for p in prompts) + cfg.generation.max_new_tokens + block}
    workdir = Path(cfg.report.path).parent if cfg.report.path else Path(tempfile.mkdtemp(prefix="dflash-eval-"))
    try:
        base = vllm_engine.run_engine(request, workdir, "vllm-target") if cfg.check.baseline else None
        spec = vllm_engine.run_engine({**request, "drafter": str(resolve_drafter_dir(cfg.drafter.path).resolve()),
                                       "num_speculative_tokens": block - 1}, workdir, "vllm-spec")
    except RuntimeError as e:
        raise UserError(str(e)) from e
    report = vllm_engine.summarize_engine(spec, base, block, [p.name for p in prompts], [len(p.ids) for p in prompts])
    report["lossless"]["checked"] = report["lossless"]["checked"] and cfg.check.lossless != "off"
    return {**report, "tau_definition": TAU_DEFINITION, "dtype": "float32", "device": "cpu (vLLM)"}


# ---------------------------------------------------------------- offline estimate


# What the offline estimate takes from the training run's run.toml: its held-out split, and how its
# validation packed and weighted the blocks, so the estimate repeats the trainer's own validation.
_RUN_SETTINGS = {"holdout_sequences": ("data", "holdout_sequences"), "holdout_fraction": ("data", "holdout_fraction"),
                 "batch_tokens": ("data", "batch_tokens"), "max_anchors": ("objective", "max_anchors"),
                 "gamma": ("objective", "gamma")}


def _training_run_settings(drafter_path: str) -> dict:
    """Settings of the training run behind `drafter_path` (its run.toml, in a run or step-N directory
    or beside a run's drafter/), by the keyword names of `evaluate_offline`; {} when there is none."""
    import tomllib

    here = Path(drafter_path)
    for candidate in (here / "run.toml", here.parent / "run.toml"):
        if candidate.is_file():
            run = tomllib.loads(candidate.read_text())
            return {key: run[sec][name] for key, (sec, name) in _RUN_SETTINGS.items()
                    if run.get(sec, {}).get(name) is not None}
    return {}


def run_offline(cfg: EvalConfig) -> dict:
    """The offline estimate: per-position accuracy and the tau it implies on a store's held-out
    sequences, by the trainer's own validation (train/validate.py), and the path tau: greedy decoding
    replayed from the stored responses with generation.block_size and generation.max_new_tokens
    (train/path_tau.py; what dflash-eval measures when the responses are the target's greedy output).
    The target never runs; only its embedding and lm_head are read from target.path."""
    from transformers import AutoConfig

    from dflash_common.drafter.target_head import load_target_head
    from train.validate import evaluate_offline, path_tau_offline

    if not cfg.offline.store:
        raise UserError("--offline needs a store: pass --store PATH (a store written by dflash-precompute).")
    _check_model_dir(cfg.target.path)
    device = resolve_device(cfg.target.device)
    bf16 = cfg.target.dtype == "bfloat16"  # the trainer's precision: fp32 weights, bf16 autocast
    drafter = load_dflash(cfg.drafter.path, AutoConfig.from_pretrained(cfg.target.path), device, torch.float32)
    head = load_target_head(cfg.target.path, device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
    drafter.attach_frozen(head.embed, head.lm_head)
    settings = _training_run_settings(cfg.drafter.path)
    for key in ("holdout_sequences", "holdout_fraction"):
        if getattr(cfg.offline, key) is not None:
            settings[key] = getattr(cfg.offline, key)
    autocast = "bf16" if bf16 else "none"
    metrics = evaluate_offline(drafter, cfg.offline.store, autocast=autocast, path=False, **settings)
    split = {k: settings[k] for k in ("holdout_sequences", "holdout_fraction", "batch_tokens") if k in settings}
    path = path_tau_offline(drafter, cfg.offline.store, block_size=cfg.generation.block_size,
                            max_new_tokens=cfg.generation.max_new_tokens, autocast=autocast, **split)
    path.pop("path_prompt_tails")
    report = {"mode": "offline", "store": cfg.offline.store, "drafter": cfg.drafter.path,
              "block_size": drafter.cfg.block_size, **settings, **metrics, **path,
              "path_max_new_tokens": cfg.generation.max_new_tokens,
              "path_block_size": cfg.generation.block_size or drafter.cfg.block_size}
    if cfg.report.path:
        write_report(report, cfg.report.path, cfg)
    print(format_offline(report))
    return report


def format_offline(report: dict) -> str:
    lines = [
        f"dflash-eval --offline: {report['sequences']} held-out sequences, {report['blocks']} blocks, "
        f"block size {report['block_size']}",
        f"  {'tau (estimated)':<28}{_fmt(report['tau'], '.3f')}",
        f"  {'path tau (replayed)':<28}{_fmt(report.get('path_tau'), '.3f')}   pooled "
        f"{_fmt(report.get('path_tau_pooled'), '.3f')}, {report.get('path_cycles', 0)} cycles of "
        f"{report.get('path_sequences', 0)} responses (greedy decoding replayed; exact on target-greedy data)",
        f"  {'accuracy':<28}{_fmt(report['acc'], '.4f')}",
        f"  {'loss':<28}{_fmt(report['loss'], '.4f')}",
        "  accuracy by block position (k = 1 predicts the token after the anchor)",
    ]
    lines += [f"    {k:>3}  {acc * 100:5.1f}%" for k, acc in enumerate(report["acc_by_pos"], start=1)]
    return "\n".join(lines)


DESCRIPTION = """Acceptance length (tau) of a DFlash drafter by real speculative decoding on its target, with
the lossless check, tokens/s with and without the drafter and the speedup.
  dflash-eval --config FILE --drafter DIR [--report FILE.json]
  dflash-eval --offline --store PATH --drafter DIR --target.path=DIR
      (estimate from the store's held-out sequences: only the target's embedding and lm_head are read)"""


@user_errors_exit
def main(argv: Sequence[str] | None = None) -> None:
    import sys

    cfg, args = parse_args(EvalConfig, sys.argv[1:] if argv is None else argv, prog="dflash-eval",
                           description=DESCRIPTION,
                           shortcuts={"drafter": "drafter.path", "report": "report.path", "store": "offline.store",
                                      "engine": "target.engine"},
                           switches={"offline": (None, ("estimate tau from a store's held-out sequences (--store); "
                                                        "the target does not run"))})
    setup_logging()
    if args.offline:
        run_offline(cfg)
        return
    try:
        run(cfg)
    except LosslessError as e:
        exit_with_error(str(e), code=1)


if __name__ == "__main__":
    main()
