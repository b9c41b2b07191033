"""One `dflash-generate` job, on every rank: the target answers the input conversations again.

    the output directory must be writable, the inputs must exist (each one sentence, before all)
    rank 0 resolves the sampling settings and fingerprints the target -> the output's key, checked
      against an existing manifest.json (another target's answers are never mixed in: the refusal
      names the settings that differ), every rank agrees
    every rank reads the whole input, parses the records of its sort windows of work units and
      renders their first prompts -> the plan (prompts, skips, tokens in, max tokens out), printed
      by rank 0; --dry-run stops here, having written nothing
    rank 0 creates the output directory (or takes over one without answers) and its manifest
    every rank loads the target and runs its sort windows, round by round (turn 1 of every
      conversation of the sort window, then turn 2 of those that have one, ...); each finished
      unit is written aside and renamed into place as `u<unit:08d>-<16 hex>.jsonl`
    a barrier -> rank 0 writes manifest.json: key, settings, counts, finish reasons, skips by reason

Work units and sort windows are those of dflash-precompute (precompute/units.py): unit u holds
input records [u*S, (u+1)*S), sort windows of `generate.sort_window_units` units go round-robin to
the ranks, and a sort window is batched the same way whatever the number of ranks, so the output
does not depend on it. A shard's name hashes the unit's records and the output's key (target,
sampling, turns, template options), so a rerun finds the shards already published and skips them; a
sort window is computed whole when any of its units is missing (the same batches as an
uninterrupted run), its published units are not written again. Per-unit counts sit in
`.units/<shard>.json`, written before the shard's rename.

dflash-precompute reads the directory as input (`data.inputs = [DIR]`: its *.jsonl files, never
manifest.json nor hidden files).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dflash_common.chat import ChatMaskError, answer_text, prompt_ids
from dflash_common.cli import RateBar, write_run_record
from dflash_common.conversations import BadRecord
from dflash_common.dist import WINDOWS_TIMEOUT, Ranks, run_on_ranks
from dflash_common.errors import UserError
from dflash_common.fingerprint import target_fingerprint
from dflash_common.fsutil import atomic_write_text, check_writable
from dflash_common.hf import generation_config, load_causal_lm, load_tokenizer, stop_token_ids
from dflash_common.sampling import Sampling
from precompute.generate.chats import Chat, parse_chat
from precompute.generate.config import GenerateConfig
from precompute.generate.decode import Request, TransformersDecoder, VllmDecoder
from precompute.inputs import RawRecord, SkipLog, iter_raw_records, resolve_inputs
from precompute.units import iter_unit_records, num_units

log = logging.getLogger("dflash")

# format 2: records' "source" and the unit names name input files without their paths
FORMAT = "dflash-generate/2"
MANIFEST = "manifest.json"
UNIT_STATS = ".units"  # hidden: no reader of the directory ever takes it for input
DEFAULT_MAX_NEW_TOKENS = 2048


def run(cfg: GenerateConfig) -> Path:
    """Run (or resume) the generation job `cfg` describes; returns the output directory."""
    if not cfg.output.dir.strip():
        raise UserError(
            "output.dir is not set; pass --out DIR (a new or an existing output directory)."
        )
    if not cfg.target.path.strip():
        raise UserError(
            "target.path is not set; pass --target.path=DIR, a local checkpoint directory."
        )
    check_writable(cfg.output.dir, "output.dir", "pass --out a directory on a writable filesystem")

    def full(why: str) -> str:
        return (
            f"the filesystem of {cfg.output.dir} is full ({why}); free space and rerun the same "
            "command: published shards are kept and the job resumes."
        )

    with run_on_ranks(cfg.run.device, full_disk=full, timeout=WINDOWS_TIMEOUT) as ranks:
        return _run(cfg, ranks)


def _run(cfg: GenerateConfig, ranks: Ranks) -> Path:
    """Everything a refusal or a dry run needs is read first; the output directory is written only
    once the plan is made (a refused or dry run leaves nothing behind)."""
    started = time.perf_counter()
    out = Path(cfg.output.dir)
    tokenizer = load_tokenizer(cfg.target.path)
    sources = resolve_inputs(cfg.data.inputs)
    sampling, stop_ids = resolve_sampling(cfg, tokenizer)
    settings = ranks.from_main(lambda: check_output(out, output_settings(cfg, sampling)))
    work = plan_work(cfg, ranks, sources, tokenizer, settings["key"])
    plan = gather_plan(ranks, work, sampling, cfg.run.samples_per_unit)
    if ranks.main:
        print(format_plan(plan, cfg), flush=True)
    if cfg.run.dry_run:
        return out
    ranks.from_main(lambda: claim_output(out, settings))
    if ranks.main:
        write_run_record(out, cfg, name="generate.run")
    planned = time.perf_counter()
    stats = generate_sort_windows(cfg, ranks, work, tokenizer, sampling, stop_ids)
    everyone = ranks.gather(stats)  # also the barrier: every rank's shards are published
    if ranks.main:
        manifest = write_manifest(
            out,
            settings,
            plan["names"],
            plan,
            everyone,
            time.perf_counter() - planned,
            time.perf_counter() - started,
            ranks.world,
        )
        print(format_manifest(manifest), flush=True)
    return out


# ---------------------------------------------------------------------------------------- settings


def resolve_sampling(cfg: GenerateConfig, tokenizer: Any) -> tuple[Sampling, frozenset[int]]:
    """Settings left unset come from the target's generation_config.json (greedy when it does not
    sample); the stop ids are the tokenizer's eos and generation_config's eos_token_id."""
    gen, s = generation_config(cfg.target.path), cfg.sampling
    samples = bool(gen.get("do_sample", False))
    temperature = (
        s.temperature
        if s.temperature is not None
        else (float(gen.get("temperature", 1.0)) if samples else 0.0)
    )
    top_p = s.top_p if s.top_p is not None else (float(gen.get("top_p", 1.0)) if samples else 1.0)
    top_k = s.top_k if s.top_k is not None else (int(gen.get("top_k", 0) or 0) if samples else 0)
    max_new = s.max_new_tokens or int(gen.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)
    stop = stop_token_ids(gen, tokenizer)
    if not stop:
        raise UserError(
            f"target.path {cfg.target.path} names no end-of-turn token (tokenizer eos or "
            "generation_config.json eos_token_id); add one."
        )
    return Sampling(temperature, top_p, top_k, max_new, s.seed), stop


def output_settings(cfg: GenerateConfig, sampling: Sampling) -> dict[str, Any]:
    """Everything that changes the answers, and its hash (the output's key, in every shard name)."""
    fp = target_fingerprint(cfg.target.path)
    settings = {
        "format": FORMAT,
        "target": {
            "config_sha256": fp["config_sha256"],
            "weights_sha256": fp["weights_sha256"],
            "dtype": cfg.target.dtype,
            "attn_implementation": cfg.target.attn_implementation,
        },
        "sampling": dataclasses.asdict(sampling),
        "generate": {
            "turns": cfg.generate.turns,
            "on_length": cfg.generate.on_length,
            "backend": cfg.generate.backend,
        },
        "data": {
            "format": cfg.data.format,
            "chat_template_kwargs": cfg.data.chat_template_kwargs,
            "max_prompt_length": cfg.data.max_prompt_length,
        },
        "samples_per_unit": cfg.run.samples_per_unit,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return {"key": key, "settings": settings, "target_fingerprint": fp}


def check_output(out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Refuse an output directory whose answers were made otherwise, naming the settings that
    differ; writes nothing. A directory without answers (only a manifest, e.g. of an older dry run)
    is taken over by `claim_output`, whatever its manifest says."""
    if not any(out.glob("u*.jsonl")):
        return settings
    manifest = out / MANIFEST
    if not manifest.is_file():
        raise UserError(
            f"output.dir {out} holds shards but no {MANIFEST}; choose a new output.dir."
        )
    try:
        old = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise UserError(
            f"output.dir {out} holds answers but its {MANIFEST} cannot be read ({e}); "
            "choose a new output.dir."
        ) from e
    if old.get("key") != settings["key"]:
        differ = settings_that_differ(old.get("settings") or {}, settings["settings"])
        keys = f"manifest key {str(old.get('key'))[:12]} != {settings['key'][:12]}"
        raise UserError(
            f"output.dir {out} holds answers made with other settings: "
            f"{', '.join(differ) or keys}; choose a new output.dir, or rerun with the "
            f"settings of its {MANIFEST}."
        )
    return settings


# The manifest's settings by the names a user sets them; the target's hashes stand for its files.
_SETTING_NAMES = {
    "target.config_sha256": "the target's config_sha256",
    "target.weights_sha256": "the target's weights_sha256",
    "samples_per_unit": "run.samples_per_unit",
    "format": "the dflash-generate format",
}


def settings_that_differ(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`name (old -> new)` for each setting two manifests disagree on (hashes cut to 12 digits)."""

    def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        items: dict[str, Any] = {}
        for key, value in tree.items():
            items.update(
                flat(value, f"{prefix}{key}.")
                if isinstance(value, dict) and value
                else {prefix + key: value}
            )
        return items

    def said(key: str, value: Any) -> str:
        if value is None:
            return "unset"
        return str(value)[:12] if key.endswith("sha256") else json.dumps(value)

    a, b = flat(old), flat(new)
    keys = sorted(set(a) | set(b), key=lambda k: (not k.startswith("target."), k))
    return [
        f"{_SETTING_NAMES.get(k, k)} ({said(k, a.get(k))} -> {said(k, b.get(k))})"
        for k in keys
        if a.get(k) != b.get(k)
    ]


def claim_output(out: Path, settings: dict[str, Any]) -> None:
    """Create the output directory (or take over one without answers), remove what writes cut by a
    kill left behind, and write the manifest's settings before any answer."""
    (out / UNIT_STATS).mkdir(parents=True, exist_ok=True)
    manifest = out / MANIFEST
    try:
        same = json.loads(manifest.read_text()).get("key") == settings["key"]
    except (OSError, ValueError):
        same = False
    if not same:  # new, or without answers (check_output): counts of absent shards go
        for stale in (out / UNIT_STATS).glob("*.json"):
            stale.unlink()
        atomic_write_text(manifest, json.dumps({**settings, "runs": []}, indent=2))
    remove_leftovers(out)


def remove_leftovers(out: Path) -> None:
    for tmp in list(out.glob(".u*.tmp-*")) + list((out / UNIT_STATS).glob(".u*.tmp-*")):
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------- plan


@dataclasses.dataclass
class Unit:
    index: int
    name: str
    published: bool
    records: int
    chats: list[Chat]
    skips: SkipLog


@dataclasses.dataclass
class RankWork:
    """This rank's units (in unit order) and the input's size."""

    units: list[Unit]
    records: int
    reader_skips: SkipLog


def unit_name(index: int, records: list[RawRecord], key: str) -> str:
    from precompute.generate.chats import payload_digest

    h = hashlib.sha256(f"{key}\0unit {index}\0".encode())
    for r in records:
        h.update(f"{r.source_id}\0{payload_digest(r)}\0".encode())
    return f"u{index:08d}-{h.hexdigest()[:16]}.jsonl"


def plan_work(cfg: GenerateConfig, ranks: Ranks, sources, tokenizer: Any, key: str) -> RankWork:
    """Name this rank's units, and parse the records of its sort windows that hold a unit still to
    write."""
    reader_skips, per_sort_window = SkipLog(cfg.data.report_first), cfg.generate.sort_window_units
    out, count = Path(cfg.output.dir), [0]

    def counted():
        for r in iter_raw_records(sources, reader_skips):
            count[0] = r.index + 1
            yield r

    grouped = list(
        iter_unit_records(
            counted(), cfg.run.samples_per_unit, ranks.rank, ranks.world, per_sort_window
        )
    )
    named = [(u, recs, unit_name(u, recs, key)) for u, recs in grouped]
    todo_sort_windows = {u // per_sort_window for u, _, name in named if not (out / name).is_file()}
    units = []
    for u, recs, name in named:
        skips, chats = SkipLog(cfg.data.report_first), []
        if u // per_sort_window in todo_sort_windows:
            chats = [c for c in (_chat_or_skip(r, cfg, skips) for r in recs) if c is not None]
            for c in chats:
                render_next(c, tokenizer, cfg, skips)
            chats = [c for c in chats if c.prompt is not None]
        units.append(Unit(u, name, (out / name).is_file(), len(recs), chats, skips))
    return RankWork(units, count[0], reader_skips)


def _chat_or_skip(raw: RawRecord, cfg: GenerateConfig, skips: SkipLog) -> Chat | None:
    try:
        return parse_chat(raw, cfg.data.format, cfg.generate.turns)
    except BadRecord as e:
        skips.add(raw.source_id, e.reason, e.detail)
        return None


def render_next(chat: Chat, tokenizer: Any, cfg: GenerateConfig, skips: SkipLog) -> None:
    """Render the prompt of the chat's next turn into `chat.prompt`, or end the chat (None): a
    template error or a first prompt too long skip the record; a later prompt too long ends the
    conversation."""
    messages = chat.next_messages()
    try:
        ids = prompt_ids(tokenizer, messages, cfg.data.chat_template_kwargs, chat.tools)
    except ChatMaskError as e:
        skips.add(chat.source_id, e.reason, e.detail)
        chat.prompt, chat.failed = (
            None,
            True,
        )  # the record is skipped, even after turns were answered
        chat.segments.clear()
        return
    if len(ids) > cfg.data.max_prompt_length:
        chat.stop()
        chat.prompt = None
        if not chat.finish_reasons:
            skips.add(
                chat.source_id,
                "prompt_too_long",
                f"{len(ids)} tokens > data.max_prompt_length {cfg.data.max_prompt_length}",
            )
        return
    chat.prompt = ids


def gather_plan(
    ranks: Ranks, work: RankWork, sampling: Sampling, samples_per_unit: int
) -> dict[str, Any]:
    """The plan of the whole job from every rank's units."""
    mine = [
        {
            "index": u.index,
            "name": u.name,
            "published": u.published,
            "records": u.records,
            "prompts": len(u.chats),
            "turns": sum(len(c.segments) + 1 for c in u.chats),
            "tokens_in": sum(len(c.prompt or []) for c in u.chats),
            "skips": u.skips.to_dict(),
        }
        for u in work.units
    ]
    units = sorted((x for part in ranks.gather(mine) for x in part), key=lambda x: x["index"])
    skips = SkipLog(work.reader_skips.report_first)
    for x in units:
        if not x["published"]:
            skips.merge(SkipLog.from_dict(x["skips"]))
    skips.merge(work.reader_skips)
    todo = [x for x in units if not x["published"]]
    turns = sum(x["turns"] for x in units if x["prompts"])  # of every sort window computed
    return {
        "records": work.records,
        "units": num_units(work.records, samples_per_unit),
        "published": len(units) - len(todo),
        "prompts": sum(x["prompts"] for x in todo),
        "prompts_run": sum(x["prompts"] for x in units),
        "turns": turns,
        "tokens_in": sum(x["tokens_in"] for x in units),
        "max_tokens_out": turns * sampling.max_new_tokens,
        "skips": skips,
        "names": [x["name"] for x in units],
        "sampling": sampling,
    }


def format_plan(plan: dict[str, Any], cfg: GenerateConfig) -> str:
    s: Sampling = plan["sampling"]
    skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(plan["skips"].counts.items())) or "none"
    how = (
        "greedy"
        if s.greedy
        else f"temperature {s.temperature}, top_p {s.top_p}, top_k {s.top_k}, seed {s.seed}"
    )
    lines = [
        f"plan: {plan['records']:,} input records -> {plan['units']:,} work units "
        f"({plan['published']:,} already in {cfg.output.dir})",
        f"  prompts to answer: {plan['prompts']:,}; skipped {plan['skips'].total:,} ({skipped})",
        f"  turns to generate: up to {plan['turns']:,} ({cfg.generate.turns} turns, "
        f"{plan['prompts_run']:,} conversations in the sort windows run); tokens in (first "
        f"prompts): {plan['tokens_in']:,}",
        f"  max tokens out: {plan['max_tokens_out']:,} ({s.max_new_tokens:,} per turn, {how}; "
        f"backend {cfg.generate.backend})",
    ]
    lines += [
        f"  e.g. skipped {sid}: {reason} ({detail})"
        for sid, reason, detail in plan["skips"].examples
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- generate


@dataclasses.dataclass
class GenStats:
    """What one rank did in this run."""

    units_written: int = 0
    turns: int = 0
    tokens_generated: int = 0
    seconds: float = 0.0


def build_decoder(
    cfg: GenerateConfig, ranks: Ranks, tokenizer: Any, sampling: Sampling, stop_ids: frozenset[int]
):
    if cfg.generate.backend == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise UserError(
                "generate.backend = 'vllm' but vllm is not installed here; install it or use "
                "--generate.backend=transformers."
            ) from None
        return VllmDecoder(
            cfg.target.path, cfg.target.dtype, sampling, stop_ids, cfg.generate.vllm_tensor_parallel
        )
    model = load_causal_lm(
        cfg.target.path,
        dtype=cfg.target.dtype,
        attn_implementation=cfg.target.attn_implementation,
        device=ranks.device,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids)
    return TransformersDecoder(
        model,
        stop_ids,
        pad,
        sampling,
        cfg.generate.token_budget,
        cfg.generate.max_batch_size,
        compile=cfg.generate.compile,
        cuda_graphs=cfg.generate.cuda_graphs,
    )


def generate_sort_windows(
    cfg: GenerateConfig,
    ranks: Ranks,
    work: RankWork,
    tokenizer: Any,
    sampling: Sampling,
    stop_ids: frozenset[int],
) -> GenStats:
    """Load the target and answer this rank's sort windows that hold a unit still to write."""
    per_sort_window = cfg.generate.sort_window_units
    sort_windows: dict[int, list[Unit]] = {}
    for u in work.units:
        w = u.index // per_sort_window
        if any(not x.published for x in work.units if x.index // per_sort_window == w):
            sort_windows.setdefault(w, []).append(u)
    stats = GenStats()
    todo = sum(len(c.segments) + 1 for us in sort_windows.values() for u in us for c in u.chats)
    log.info(
        "%d sort windows to generate (%d turns at most); %d units of this rank already written",
        len(sort_windows),
        todo,
        sum(u.published for u in work.units),
    )
    if not sort_windows:
        return stats
    decoder = build_decoder(cfg, ranks, tokenizer, sampling, stop_ids)
    started = time.perf_counter()
    bar = RateBar(
        todo,
        unit="prompt",
        desc=ranks.label("generate"),
        rate="generated tok/s",
        enabled=cfg.run.progress and ranks.main,
    )
    with bar as progress:
        for _, units in sorted(sort_windows.items()):
            chats = [c for u in units for c in u.chats]
            answer_sort_window(chats, decoder, tokenizer, cfg, sampling, progress, units)
            for u in units:
                if not u.published:
                    write_unit(Path(cfg.output.dir), u, cfg.generate.on_length)
                    stats.units_written += 1
    stats.turns, stats.tokens_generated = progress.done, progress.tokens
    stats.seconds = time.perf_counter() - started
    return stats


def answer_sort_window(
    chats: list[Chat],
    decoder: Any,
    tokenizer: Any,
    cfg: GenerateConfig,
    sampling: Sampling,
    progress: RateBar,
    units: list[Unit],
) -> None:
    """Every turn of the sort window's conversations: one round per turn, each round batched
    together."""
    skips_of = {id(c): u.skips for u in units for c in u.chats}
    pending = [c for c in chats if c.prompt is not None]
    while pending:
        requests = [Request(c.prompt, c.request_seed(sampling.seed)) for c in pending]  # type: ignore[arg-type]
        answers = decoder.generate(requests, progress.add_tokens)
        for chat, ans in zip(pending, answers):
            chat.answer(
                answer_text(tokenizer, ans.tokens), ans.finish_reason, len(ans.tokens), ans.emitted
            )
            progress.update(1)
            if chat.pending:
                render_next(chat, tokenizer, cfg, skips_of[id(chat)])
            else:
                chat.prompt = None
        pending = [c for c in pending if c.prompt is not None]


def write_unit(out: Path, unit: Unit, on_length: str) -> None:
    """The unit's records as one JSONL shard, and its
    counts beside it; the shard's rename publishes it."""
    lines, reasons, tokens = [], Counter(), 0
    for chat in unit.chats:
        if chat.failed or not chat.finish_reasons:
            continue
        if on_length == "drop" and "length" in chat.finish_reasons:
            unit.skips.add(
                chat.source_id,
                "cut_by_length",
                "a turn reached max_new_tokens (generate.on_length = drop)",
            )
            continue
        lines.append(json.dumps(chat.record(), ensure_ascii=False) + "\n")
        reasons.update(chat.finish_reasons)
        tokens += chat.generated_tokens
    stats = {
        "index": unit.index,
        "records": unit.records,
        "conversations": len(lines),
        "turns": sum(reasons.values()),
        "finish_reasons": dict(reasons),
        "generated_tokens": tokens,
        "skips": unit.skips.to_dict(),
    }
    atomic_write_text(out / UNIT_STATS / f"{unit.name}.json", json.dumps(stats))
    atomic_write_text(out / unit.name, "".join(lines))


# ---------------------------------------------------------------------------------------- manifest


def write_manifest(
    out: Path,
    settings: dict[str, Any],
    names: list[str],
    plan: dict[str, Any],
    stats: list[GenStats],
    gen_s: float,
    total_s: float,
    world: int,
) -> dict[str, Any]:
    """manifest.json: the key and settings, totals over every unit's counts, one entry per run."""
    totals: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    skips = SkipLog(plan["skips"].report_first)
    missing = 0
    for name in names:
        file = out / UNIT_STATS / f"{name}.json"
        if not (out / name).is_file() or not file.is_file():
            missing += 1
            continue
        unit = json.loads(file.read_text())
        totals.update(
            {k: unit[k] for k in ("records", "conversations", "turns", "generated_tokens")}
        )
        reasons.update(unit["finish_reasons"])
        skips.merge(SkipLog.from_dict(unit["skips"]))
    old = json.loads((out / MANIFEST).read_text())
    tokens = sum(s.tokens_generated for s in stats)
    this_run = {
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": world,
        "units_written": sum(s.units_written for s in stats),
        "units_already_written": plan["published"],
        "turns": sum(s.turns for s in stats),
        "tokens_generated": tokens,
        "seconds": round(total_s, 3),
        "generated_tokens_per_s": round(
            tokens / max(1e-9, max(s.seconds for s in stats) or gen_s), 1
        ),
    }
    manifest = {
        **settings,
        "units": len(names),
        "units_missing": missing,
        "counts": dict(totals),
        "finish_reasons": dict(sorted(reasons.items())),
        "skips": skips.to_dict(),
        "runs": old.get("runs", []) + [this_run],
    }
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2))
    return manifest


def format_manifest(m: dict[str, Any]) -> str:
    run = m["runs"][-1]
    c = m["counts"]
    skips = ", ".join(f"{k} {v:,}" for k, v in m["skips"]["counts"].items()) or "none"
    reasons = ", ".join(f"{k} {v:,}" for k, v in m["finish_reasons"].items()) or "none"
    return "\n".join(
        [
            f"done: {c.get('conversations', 0):,} conversations ({c.get('turns', 0):,} turns, "
            f"{c.get('generated_tokens', 0):,} generated tokens) in {m['units']:,} shards; finish "
            f"reasons: {reasons}",
            f"  skipped records: {skips}",
            f"  this run: {run['units_written']:,} shards written, "
            f"{run['units_already_written']:,} already there; {run['tokens_generated']:,} tokens "
            f"generated at {run['generated_tokens_per_s']:,.0f} tok/s on {run['world_size']} "
            f"rank(s) in {run['seconds']:.1f} s",
        ]
    )
