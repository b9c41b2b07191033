"""A `dflash-eval` run: a drafter's acceptance length tau by real speculative decoding on the user's
target, with the lossless check, tokens/s with and without the drafter, and the speedup; decoded
here through transformers (train/eval/spec_decode.py) or through vLLM (train/eval/vllm_engine.py).

tau is measured as the DFlash authors' loop does (z-lab/dflash `dflash/model.py`, `spec_generate`;
see TAU_DEFINITION, which the report carries): each draft-verify cycle drafts a whole block and
counts accepted drafts + 1, uncut, even past the length limit or a stop token; the prefill's token
is not counted; per prompt the mean over its cycles, then the mean over prompts. Beside it the
pooled figure engines log, 1 + accepted / drafts over all cycles (`tau_pooled`), and `tau_emitted`:
the same mean over the tokens each cycle adds to the output cut at the limit and the stop token
(only the last cycle of a response differs; path tau, train/path_tau.py, reproduces it exactly from
a store). Throughput also follows the reference: time per output token is the decode time (after the
prefill) over the new tokens, averaged over prompts; tokens/s is its inverse; speedup is the ratio
of the two.

Prompts are decoded one at a time (`generation.batch_size = 1`, the CPU's default) or many at
once (train/eval/batched.py, a GPU's default): then every prompt of a batch is decoded side by side,
with the drafter and with the target alone, and a prompt's decode time is the batch's time until
that prompt finished, so tokens/s is per prompt at that batch size (the report says which). Each
prompt's tokens and cycles are the same either way in float32; the lossless check still compares
prompt by prompt. Multi-turn prompts are decoded a turn at a time: every prompt's first turn, then
every second turn (answered by the first turn's speculative output), and so on.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from dflash_common.cli import progress_bar

from dflash_common.dist import resolve_device
from dflash_common.errors import UserError
from dflash_common.sampling import Sampling
from dflash_common.hf import (
    generation_config,
    load_causal_lm,
    load_text_config,
    load_tokenizer,
    stop_token_ids,
    torch_dtype,
)
from dflash_common.drafter.layer_ids import check_layer_ids
from train.eval.baseline_cache import BaselineCache
from train.eval.config import EvalConfig, GenerationSection
from train.eval.load import attach_target, load_dflash
from train.eval.prompts import Prompt, load_prompts, render_chat
from train.eval.report import (
    first_mismatch,
    format_report,
    lossless_message,
    mismatch_entry,
    write_report,
)
from train.eval.spec_decode import (
    Decoded,
    Drafter,
    TargetRunner,
    speculative_generate,
    target_generate,
)

if TYPE_CHECKING:  # imported where used: it imports transformers, which the CLI need not load early
    from train.eval import batched

log = logging.getLogger("dflash")

TAU_DEFINITION = (
    "tau: per prompt the mean over its draft-verify cycles of (accepted drafts + 1), then the mean "
    "over prompts, counted as the DFlash authors' loop does (z-lab/dflash spec_generate: whole "
    "blocks while the anchor is below the length limit, every cycle uncut, stop after the cycle "
    "that emits a stop token); tau_pooled: 1 + accepted / drafts over all cycles of all prompts, "
    "as engines log it (vLLM); tau_emitted: as tau, but each cycle counts only the tokens it adds "
    "to the output cut at the length limit and after the stop token (cycles adding none dropped), "
    "so only the last cycle of a prompt differs; it is what path tau (dflash-eval --offline) "
    "replays exactly."
)


class LosslessError(RuntimeError):
    """Greedy speculative decoding emitted something the target alone would not have."""


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


# ---------------------------------------------------------------- decoding


@dataclass(frozen=True)
class Settings:
    """How every prompt is decoded (resolved from the config and the drafter); prompt i draws with
    a generator of seed `sampling.seed + i`."""

    block_size: int
    sampling: Sampling  # the distribution, the token limit and the seed
    stop_ids: frozenset[int]
    baseline: bool  # also decode with the target alone
    check_lossless: bool  # greedy, with a baseline to compare against
    baseline_cache: BaselineCache | None = None  # the target-alone decodes of earlier evaluations
    batch_size: int = 1  # prompts decoded at once (batched.py when > 1)
    draft_sampling: str = "greedy"  # or "probabilistic": drafts drawn from the drafter (sampling)


def settings_from(
    gen: GenerationSection,
    check_lossless: str,
    baseline: bool,
    block_size: int,
    stop_ids: frozenset[int],
    batch_size: int = 1,
    anchor_predicts: int = 0,
) -> Settings:
    """`block_size`: the drafter's verified block [anchor, drafts]; generation.block_size is a
    drafter's block B, which a DSpark drafter (`anchor_predicts` 1) verifies with its anchor:
    B + 1."""
    sampling = Sampling(gen.temperature, gen.top_p, gen.top_k, gen.max_new_tokens, gen.seed)
    return Settings(
        block_size=gen.block_size + anchor_predicts if gen.block_size else block_size,
        sampling=sampling,
        stop_ids=frozenset() if gen.ignore_eos else stop_ids,
        baseline=baseline,
        check_lossless=sampling.greedy and baseline and check_lossless != "off",
        batch_size=batch_size,
        draft_sampling=gen.draft_sampling,
    )


def resolve_batch_size(
    gen: GenerationSection, model, drafter: Drafter, device: torch.device
) -> int:
    """generation.batch_size, with 0 resolved: 1 on a CPU or where batching cannot serve, else
    AUTO_ROWS (each batch then capped by memory). An explicit size > 1 that cannot be served is
    refused."""
    from train.eval import batched

    why = batched.batch_refusal(model)
    if why is None:
        why = batched.drafter_refusal(drafter)
    if gen.batch_size == 0:
        batchable = device.type == "cuda" and gen.temperature == 0 and why is None
        return batched.AUTO_ROWS if batchable else 1
    if gen.batch_size > 1 and why is not None:
        raise UserError(
            f"generation.batch_size = {gen.batch_size}: {why}; set generation.batch_size = 1."
        )
    return gen.batch_size


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def decode_one(
    target: TargetRunner, drafter: Drafter, name: str, ids: list[int], s: Settings, index: int
) -> PromptResult:
    """Speculative decoding of one prompt, then (optionally) the target alone, and the
    comparison."""
    limit, seed = s.sampling.max_new_tokens, s.sampling.seed + index
    spec = speculative_generate(
        target,
        drafter,
        ids,
        block_size=s.block_size,
        max_new_tokens=limit,
        stop_ids=s.stop_ids,
        sampling=s.sampling,
        generator=_generator(target.device, seed),
        draft_sampling=s.draft_sampling,
    )
    base = None
    if s.baseline:
        cache, key = s.baseline_cache, None
        if cache is not None:
            key = cache.key(ids, limit, s.sampling, seed, s.stop_ids)
            base = cache.get(key)
        if base is None:
            base = target_generate(
                target,
                ids,
                max_new_tokens=limit,
                stop_ids=s.stop_ids,
                sampling=s.sampling,
                generator=_generator(target.device, seed),
            )
            if cache is not None:
                cache.put(key, base)
    mismatch = first_mismatch(spec.tokens, base.tokens) if s.check_lossless else None
    return PromptResult(name, len(ids), spec, base, mismatch)


def _warm_up(target: TargetRunner, drafter: Drafter, ids: list[int], s: Settings) -> None:
    """One short decode of each kind, untimed: kernels and allocators are set up before the clock
    runs."""
    limit = min(s.sampling.max_new_tokens, 2 * s.block_size)
    short = dataclasses.replace(s.sampling, max_new_tokens=limit)
    decode_one(target, drafter, "warm-up", ids, dataclasses.replace(s, sampling=short), index=0)


def decode_prompts(
    target: TargetRunner,
    drafter: Drafter,
    prompts: Sequence[Prompt],
    s: Settings,
    *,
    tokenizer=None,
    template_kwargs: dict | None = None,
    warmup: bool = True,
) -> list[PromptResult]:
    """Decode every prompt (each turn of a multi-turn prompt is a prompt of its own)."""
    if s.batch_size > 1:
        return decode_prompts_batched(
            target,
            drafter,
            prompts,
            s,
            tokenizer=tokenizer,
            template_kwargs=template_kwargs,
            warmup=warmup,
        )
    results: list[PromptResult] = []
    for prompt in progress_bar(
        prompts, enabled=len(prompts) > 1, desc="dflash-eval", unit="prompt"
    ):
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
            result = decode_one(
                target, drafter, f"{prompt.name}#turn{turn + 1}", ids, s, len(results)
            )
            results.append(result)
            answer = tokenizer.decode(result.spec.tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
    return results


# ---------------------------------------------------------------- decoding, batched


@dataclass(frozen=True)
class _Item:
    """One prompt (or one turn of one) to decode; `slot` is its place in decode_prompts' order,
    which also offsets its seed as there."""

    slot: int
    name: str
    ids: list[int]


def decode_prompts_batched(
    target: TargetRunner,
    drafter: Drafter,
    prompts: Sequence[Prompt],
    s: Settings,
    *,
    tokenizer=None,
    template_kwargs: dict | None = None,
    warmup: bool = True,
) -> list[PromptResult]:
    """`decode_prompts` in batches of up to s.batch_size prompts (batched.py): every prompt's first
    turn, then every second turn, and so on; the results in decode_prompts' order. The bar counts
    tokens: each prompt's limit, once with the drafter and once with the target alone."""
    from train.eval import batched

    engine = batched.BatchedTarget(target.model, target.layer_ids)
    proposer = batched.as_batched(drafter)
    turns = [1 if p.ids is not None else len(p.turns) for p in prompts]
    first_slot = [sum(turns[:i]) for i in range(len(prompts))]
    results: list[PromptResult | None] = [None] * sum(turns)
    messages: list[list[dict]] = [[] for _ in prompts]
    total = len(results) * s.sampling.max_new_tokens * (2 if s.baseline else 1)
    with progress_bar(total=total, enabled=len(results) > 1, desc="dflash-eval", unit="tok") as bar:
        for turn in range(max(turns, default=0)):
            items = []
            for i, prompt in enumerate(prompts):
                if prompt.ids is not None and turn == 0:
                    items.append(_Item(first_slot[i], prompt.name, prompt.ids))
                elif prompt.ids is None and turn < turns[i]:
                    messages[i].append({"role": "user", "content": prompt.turns[turn]})
                    ids = render_chat(tokenizer, messages[i], template_kwargs or {}, prompt.name)
                    items.append(_Item(first_slot[i] + turn, f"{prompt.name}#turn{turn + 1}", ids))
            batches = _batches(items, s, target.model, proposer)
            if warmup and turn == 0:  # untimed: kernels and allocators are set up before the clock
                limit = min(s.sampling.max_new_tokens, 2 * s.block_size)
                short = dataclasses.replace(
                    s,
                    sampling=dataclasses.replace(s.sampling, max_new_tokens=limit),
                    baseline_cache=None,
                )
                decode_batch(engine, proposer, batches[0], short)
            for batch in batches:
                done = decode_batch(engine, proposer, batch, s, bar.update)
                for item, result in zip(batch, done):
                    results[item.slot] = result
            for i, prompt in enumerate(prompts):
                if prompt.ids is None and turn < turns[i]:
                    spoken = results[first_slot[i] + turn].spec.tokens
                    answer = tokenizer.decode(spoken, skip_special_tokens=True)
                    messages[i].append({"role": "assistant", "content": answer})
    return results


def _batches(items: list[_Item], s: Settings, model, proposer) -> list[list[_Item]]:
    """The items by prompt length, longest first (a batch pads to its longest prompt), in batches
    of s.batch_size, fewer where the GPU's memory holds fewer rows of that length."""
    from train.eval import batched

    order = sorted(items, key=lambda item: -len(item.ids))
    out, a = [], 0
    while a < len(order):
        length = len(order[a].ids) + s.sampling.max_new_tokens + 2 * s.block_size
        rows = min(s.batch_size, batched.rows_that_fit(model, proposer, length, s.block_size))
        out.append(order[a : a + rows])
        a += rows
    return out


def decode_batch(
    engine: batched.BatchedTarget,
    proposer: batched.BatchedDrafter,
    items: list[_Item],
    s: Settings,
    on_tokens: batched.OnTokens | None = None,
) -> list[PromptResult]:
    """One batch with the drafter, then the target alone (those the baseline cache lacks), and the
    comparison, prompt by prompt."""
    from train.eval import batched

    prompts, limit = [item.ids for item in items], s.sampling.max_new_tokens
    specs = batched.speculative_generate_batch(
        engine,
        proposer,
        prompts,
        block_size=s.block_size,
        max_new_tokens=limit,
        stop_ids=s.stop_ids,
        on_tokens=on_tokens,
    )
    bases: list[Decoded | None] = [None] * len(items)
    if s.baseline:
        cache = s.baseline_cache
        keys = (
            [None] * len(items)
            if cache is None
            else [
                cache.key(
                    item.ids,
                    limit,
                    s.sampling,
                    s.sampling.seed + item.slot,
                    s.stop_ids,
                    s.batch_size,
                )
                for item in items
            ]
        )
        bases = [cache.get(key) if cache is not None else None for key in keys]
        missing = [i for i, base in enumerate(bases) if base is None]
        if on_tokens is not None and len(missing) < len(items):
            on_tokens(limit * (len(items) - len(missing)))
        made = (
            batched.target_generate_batch(
                engine,
                [prompts[i] for i in missing],
                max_new_tokens=limit,
                stop_ids=s.stop_ids,
                on_tokens=on_tokens,
            )
            if missing
            else []
        )
        for i, base in zip(missing, made):
            bases[i] = base
            if cache is not None:
                cache.put(keys[i], base)
    return [
        PromptResult(
            item.name,
            len(item.ids),
            spec,
            base,
            first_mismatch(spec.tokens, base.tokens) if s.check_lossless else None,
        )
        for item, spec, base in zip(items, specs, bases)
    ]


def target_answers(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: frozenset[int],
    batch_size: int,
    block_size: int = 16,
) -> list[list[int]]:
    """The target's own greedy answers, decoded as dflash-eval decodes its baseline (the reference
    its lossless check compares with) at this batch size: one at a time, or in its batches (by
    prompt length, longest first; where memory caps a batch, dflash-eval's also holds a drafter of
    `block_size` and may split them elsewhere). Answers meant to be replayed against dflash-eval's
    (path tau) are made here, on the device dflash-eval runs on."""
    from train.eval import batched

    target = TargetRunner(model, [])
    if batch_size == 1:
        return [
            target_generate(target, p, max_new_tokens=max_new_tokens, stop_ids=stop_ids).tokens
            for p in prompts
        ]
    s = Settings(
        block_size,
        Sampling(max_new_tokens=max_new_tokens),
        stop_ids,
        True,
        True,
        batch_size=batch_size,
    )
    engine, answers = batched.BatchedTarget(model, []), [None] * len(prompts)
    items = [_Item(i, str(i), list(p)) for i, p in enumerate(prompts)]
    for batch in _batches(items, s, model, None):
        made = batched.target_generate_batch(
            engine, [item.ids for item in batch], max_new_tokens=max_new_tokens, stop_ids=stop_ids
        )
        for item, decoded in zip(batch, made):
            answers[item.slot] = decoded.tokens
    return answers


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
    mismatches = [
        mismatch_entry(r.name, r.prompt_tokens, r.first_mismatch, r.spec.tokens, r.target.tokens)
        for r in results
        if r.first_mismatch is not None
    ]
    return {
        "tau": _mean(taus),
        # the figure engines log (vLLM: 1 + num_accepted_tokens / num_drafts): every cycle weighs
        # the same
        "tau_pooled": _mean(lengths),
        # cycles cut as the output is (path tau's figure): per prompt, then over prompts
        "tau_emitted": _mean([r.tau_emitted for r in results if r.tau_emitted is not None]),
        "tau_definition": TAU_DEFINITION,
        "block_size": s.block_size,
        "batch_size": s.batch_size,  # prompts at once (1: one at a time); tokens/s are per prompt
        "num_prompts": len(results),
        "num_prompts_without_cycles": len(results) - len(taus),
        "num_cycles": len(lengths),
        "new_tokens": sum(len(r.spec.tokens) for r in results),
        # histogram[k]: share of cycles that emitted k tokens (k-1 accepted drafts + the target's
        # own)
        "histogram": {
            str(n): c / len(lengths) if lengths else 0.0
            for n, c in zip(range(1, s.block_size + 1), counts)
        },
        "histogram_counts": {str(n): c for n, c in zip(range(1, s.block_size + 1), counts)},
        "spec_tokens_per_s": 1 / spec_tpot if spec_tpot else None,
        "target_tokens_per_s": 1 / base_tpot if base_tpot else None,
        "speedup": base_tpot / spec_tpot if base_tpot and spec_tpot else None,
        "sampling": {
            "temperature": s.sampling.temperature,
            "top_p": s.sampling.top_p,
            "top_k": s.sampling.top_k,
            "draft_sampling": s.draft_sampling,
        },
        "lossless": {
            "checked": s.check_lossless,
            "ok": not mismatches if s.check_lossless else None,
            "mismatches": mismatches,
        },
        "prompts": [_prompt_entry(r) for r in results],
    }


def _prompt_entry(r: PromptResult) -> dict:
    entry = {
        "name": r.name,
        "prompt_tokens": r.prompt_tokens,
        "new_tokens": len(r.spec.tokens),
        "tau": r.tau,
        "acceptance_lengths": r.spec.acceptance_lengths,
        "emitted": r.spec.emitted,
        "spec_decode_s": r.spec.decode_s,
    }
    if r.target is not None:
        entry["target_decode_s"] = r.target.decode_s
    return entry


# ---------------------------------------------------------------- run


def evaluate_drafter(
    model, tokenizer, drafter: Drafter, cfg: EvalConfig, prompts: Sequence[Prompt]
) -> dict:
    """Decode `prompts` with `drafter` against `model`; the JSON-ready report (see `summarize`)."""
    num_layers = model.config.num_hidden_layers
    try:
        check_layer_ids(list(drafter.layer_ids), num_layers)
    except ValueError as e:
        raise UserError(
            f"the drafter does not fit this target: {e}; evaluate it on the target it was trained "
            "for."
        ) from e
    target = TargetRunner(model, drafter.layer_ids)
    s = settings_from(
        cfg.generation,
        cfg.check.lossless,
        cfg.check.baseline,
        drafter.block_size,
        stop_token_ids(model.generation_config, tokenizer),
        resolve_batch_size(cfg.generation, model, drafter, target.device),
        getattr(drafter, "anchor_predicts", 0),
    )
    log.info(
        "decoding %d prompts %s",
        len(prompts),
        "one at a time" if s.batch_size == 1 else f"in batches of up to {s.batch_size}",
    )
    if cfg.check.baseline and cfg.check.baseline_cache:
        s = dataclasses.replace(
            s,
            baseline_cache=BaselineCache.open(
                cfg.check.baseline_cache, cfg.target.path, cfg.target.dtype, str(target.device)
            ),
        )
    results = decode_prompts(
        target,
        drafter,
        prompts,
        s,
        tokenizer=tokenizer,
        template_kwargs=cfg.prompts.chat_template_kwargs,
        warmup=cfg.generation.warmup,
    )
    report = summarize(results, s)
    report["dtype"] = cfg.target.dtype
    report["device"] = str(target.device)
    return report


def run(cfg: EvalConfig) -> dict:
    """Load the target and the drafter, decode every prompt, write and print the report; a failed
    lossless check raises `LosslessError` after the report is written (`check.lossless =
    'error'`)."""
    if cfg.target.engine == "vllm":
        return finish_report(run_vllm(cfg), cfg)
    tokenizer = load_tokenizer(cfg.target.path)  # prompts are checked before the model is loaded
    prompts = load_prompts(
        cfg.prompts.files, tokenizer, cfg.prompts.chat_template_kwargs, cfg.prompts.num_prompts
    )
    # the drafter first: one that does not fit is refused before a large target is loaded
    device = resolve_device(cfg.target.device, "target.device")
    drafter = load_dflash(
        cfg.drafter.path, load_text_config(cfg.target.path), device, torch_dtype(cfg.target.dtype)
    )
    if cfg.generation.draft_sampling == "probabilistic" and drafter.cfg.arch == "dflash2":
        raise UserError(
            "generation.draft_sampling = 'probabilistic': a DFlash2 drafter proposes its "
            "selector's walk, not a draw from a distribution; set generation.draft_sampling = "
            "'greedy'."
        )
    model = load_causal_lm(
        cfg.target.path,
        dtype=cfg.target.dtype,
        device=device,
        attn_implementation=cfg.target.attn_implementation,
    )
    proposer = attach_target(
        drafter, model, cfg.generation.block_size, cfg.generation.confidence_threshold
    )
    log.info(
        "evaluating %s on %s: %d prompts, %d drafts a cycle",
        cfg.drafter.path,
        cfg.target.path,
        len(prompts),
        proposer.block_size - 1,
    )
    report = evaluate_drafter(model, tokenizer, proposer, cfg, prompts)
    return finish_report(report, cfg)


def finish_report(report: dict, cfg: EvalConfig) -> dict:
    """Write and print the report; raise `LosslessError` on a failed check (`check.lossless =
    'error'`)."""
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
    """The report measured through vLLM (train/eval/vllm_engine.py): the exported drafter served
    with its target, and the target served alone for the lossless check and the baseline."""
    import tempfile

    from dflash_common.drafter.export import resolve_drafter_dir
    from train.eval import vllm_engine

    if not vllm_engine.vllm_available():
        raise UserError(
            "--engine vllm needs vLLM importable here; run it from .venv-vllm (make serve-check "
            "builds it) or use --engine transformers."
        )
    if cfg.generation.temperature != 0 or cfg.target.dtype != "float32":
        raise UserError(
            "--engine vllm measures greedy float32 decoding; set generation.temperature = 0 and "
            "target.dtype = 'float32'."
        )
    tokenizer = load_tokenizer(cfg.target.path)
    prompts = load_prompts(
        cfg.prompts.files, tokenizer, cfg.prompts.chat_template_kwargs, cfg.prompts.num_prompts
    )
    if any(p.ids is None for p in prompts):
        raise UserError(
            "--engine vllm takes single-turn prompts; drop the 'turns' lines or use --engine "
            "transformers."
        )
    drafter = load_dflash(
        cfg.drafter.path, load_text_config(cfg.target.path), torch.device("cpu"), torch.float32
    )  # refused here, in one sentence, unless made for this target
    block = cfg.generation.block_size or drafter.cfg.block_size
    # the verified block [anchor, drafts]: a DSpark drafter drafts B
    verify = block + drafter.cfg.verify_block_size - drafter.cfg.block_size
    stops = sorted(stop_token_ids(generation_config(cfg.target.path), tokenizer))
    stops = [] if cfg.generation.ignore_eos else stops
    request = {
        "target": str(Path(cfg.target.path).resolve()),
        "prompts": [p.ids for p in prompts],
        "max_new_tokens": cfg.generation.max_new_tokens,
        "stop_ids": stops,
        "max_model_len": (
            max(len(p.ids) for p in prompts) + cfg.generation.max_new_tokens + block + 1
        ),
        # DSpark and DFlash2 need vLLM's V2 runner, so Triton: on a CPU its interpreter
        # (vllm_engine.py)
        "triton_interpreter": drafter.cfg.V2_RUNNER and not torch.cuda.is_available(),
    }
    workdir = (
        Path(cfg.report.path).parent
        if cfg.report.path
        else Path(tempfile.mkdtemp(prefix="dflash-eval-"))
    )
    try:
        base = (
            vllm_engine.run_engine(request, workdir, "vllm-target") if cfg.check.baseline else None
        )
        spec = vllm_engine.run_engine(
            {
                **request,
                "drafter": str(resolve_drafter_dir(cfg.drafter.path).resolve()),
                "num_speculative_tokens": verify - 1,
                "method": drafter.cfg.VLLM_METHOD,
            },
            workdir,
            "vllm-spec",
        )
    except RuntimeError as e:
        raise UserError(str(e)) from e
    report = vllm_engine.summarize_engine(
        spec, base, verify, [p.name for p in prompts], [len(p.ids) for p in prompts]
    )
    report["lossless"]["checked"] = report["lossless"]["checked"] and cfg.check.lossless != "off"
    return {**report, "tau_definition": TAU_DEFINITION, "dtype": "float32", "device": "cpu (vLLM)"}
