"""Quality benchmark runner: a small real target, its own greedy data, drafters over seeds, tau.

    # every stage, or one stage at a time:
    python benchmarks/quality/run.py --work runs/quality --stage all
    # target.py, ~2 min on an H200
    python benchmarks/quality/run.py --work runs/quality --stage target
    # dflash-generate + training store
    python benchmarks/quality/run.py --work runs/quality --stage data
    # where eval runs
    python benchmarks/quality/run.py --work runs/quality --stage heldout
    python benchmarks/quality/run.py --work runs/quality --stage drafters --variants baseline \\
        --seeds 0,1,2
    # dflash-eval + offline, per run
    python benchmarks/quality/run.py --work runs/quality --stage eval
    # results.md / results.json
    python benchmarks/quality/run.py --work runs/quality --stage table
    # the whole chain on a CPU
    python benchmarks/quality/run.py --work /tmp/q --tiny --stage all

Stages and what they leave in --work (a stage whose output has a matching manifest is skipped):
1. target/: benchmarks/quality/target.py (HF model dir, bf16 weights, prompts/train.jsonl,
   prompts/heldout.jsonl).
2. data/: the target's greedy answers to the training prompts by dflash-generate (data/generated/,
   conversations with each answer's token ids, which precompute stores as they are; batched HF
   generate into train.jsonl token records is the fallback), data/heldout_prompts.jsonl (the
   first --eval-prompts held-out prompts, as messages for dflash-eval); then dflash-precompute
   writes stores/train (float32 target, the regime's storage dtype, final states) and, side by side
   with it, the chosen variants' own stores (STORES below: another storage dtype, or every target
   layer captured) from the same answers: stores/train-<dtype>[-all].
3. data/heldout.jsonl: the held-out prompts answered by dflash-eval's own baseline loop (float32)
   on this stage's device, as token records, so path tau replays exactly what dflash-eval's target
   emits there: on a GPU its batched loop in its batches (train/eval/batched.py), on a CPU one
   prompt at a time (`target_generate`); answers made the other way are made again. Then
   stores/heldout.
4. runs/VARIANT/seed-S/: dflash-train per variant and seed, all side by side on the one GPU
   (separate processes). A variant is a name and a list of `--section.field=value` overrides
   (VARIANTS below), and maybe a store of its own (made here if the data stage did not: variants
   added since). At the deadline a run is stopped with SIGTERM: it saves a checkpoint, and the same
   command resumes it.
5. per run: eval.json (dflash-eval, float32, lossless required; batched on a GPU, one prompt at a
   time on a CPU: generation.batch_size's default), offline_heldout.json and offline_train.json
   (dflash-eval --offline: the estimate and path tau on the held-out store and on the training
   store's held-out split), at most --parallel processes at a time.
6. results.md / results.json: per variant, mean +- sd over seeds.

CLIs run as `python -m ...` from the repository root with PYTHONPATH=. (no console scripts needed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]

# One line per variant: name -> dflash-train overrides on top of RECIPE.
DSPARK = [
    "--drafter.arch=dspark",
    "--drafter.block_size={dspark_block}",
    "--drafter.markov_rank=64",
]
VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    # every anchor with one valid label (SpecForge HEAD's rule)
    "label": ["--objective.anchors=label"],
    "dpace": ["--objective.weights=dpace"],  # D-PACE position weights instead of exp(-(k-1)/gamma)
    "label+dpace": ["--objective.anchors=label", "--objective.weights=dpace"],
    "gamma4": ["--objective.gamma=4"],  # a faster decay: small drafters accept few tokens per block
    "lr2x": ["--optim.lr=1.2e-3"],
    "ema": ["--regularise.ema=0.99"],  # ~100-step average (a run is ~500 steps)
    "noise": ["--regularise.noise=0.1"],
    "dpace+lr2x": ["--objective.weights=dpace", "--optim.lr=1.2e-3"],
    # Muon for the linear layers' matrices (AdamW for the rest), at the recipe's lr (RMS-matched
    # update)
    "dpace+muon": ["--objective.weights=dpace", "--optim.name=muon"],
    "dpace+lr2x+label": [
        "--objective.weights=dpace",
        "--optim.lr=1.2e-3",
        "--objective.anchors=label",
    ],
    "dpace+norm_anchors": ["--objective.weights=dpace", "--objective.normalise=anchors"],
    # blocks on greedy serving's path (anchors after a rejection) weigh 1 + path_weight times
    "dpace+path1": ["--objective.weights=dpace", "--objective.path_weight=1"],
    "dpace+path3": ["--objective.weights=dpace", "--objective.path_weight=3"],
    # not a recipe change: the same drafter with its layers' elementwise parts compiled (fused
    # kernels)
    "dpace+compile": ["--objective.weights=dpace", "--precision.compile=true"],
    # not a recipe change either: the loss's softmax against the label's logit (one pass over the
    # logits; in the logits matmul's epilogue): the same objective, other roundings; tau must match
    # dpace's to become the default
    "dpace+odds": ["--objective.weights=dpace", "--precision.loss_method=odds"],
    "dpace+odds_epilogue": ["--objective.weights=dpace", "--precision.loss_method=odds_epilogue"],
    # anchors on prompt tokens too, labelled by the target's greedy token
    "prompt": ["--targets.prompt_anchors=true"],
    "dpace+prompt": ["--objective.weights=dpace", "--targets.prompt_anchors=true"],
    # the same at fewer rows a step: at most 96 (64) anchors a sequence drawn from prompt and
    # response, where the recipe's response-only anchors are about 60 a sequence (78 answer tokens
    # less a block)
    "dpace+prompt96": [
        "--objective.weights=dpace",
        "--targets.prompt_anchors=true",
        "--objective.max_anchors=96",
    ],
    "dpace+prompt64": [
        "--objective.weights=dpace",
        "--targets.prompt_anchors=true",
        "--objective.max_anchors=64",
    ],
    "kl": ["--targets.soft=kl"],  # the target's distribution (final states), not only its token
    # DSpark's loss mix alone on a DFlash drafter: 0.1 CE + 0.9 L1 to the target's distribution
    "dspark_mix": ["--targets.soft=dspark"],
    # total variation to the target's distribution
    "dpace+tv": ["--objective.weights=dpace", "--targets.soft=tv"],
    "label+dspark_mix+prompt": [
        "--objective.anchors=label",
        "--targets.soft=dspark",
        "--targets.prompt_anchors=true",
    ],
    # DSpark drafters (Markov head + confidence head), against `dpace`: a block one shorter than the
    # recipe's drafts as many tokens a cycle ({dspark_block} = the recipe's block - 1, 15), so both
    # verify equal blocks; Markov rank 64 (V x 64 over this target's 8,192 tokens; DeepSpec uses 256
    # over 151,936)
    # - our objective (the default): CE under D-PACE, the confidence head taught greedy matches on
    #   detached features
    "dspark": [*DSPARK, "--objective.weights=dpace"],
    # - the same with DeepSpec's Markov rank, 256 (the selector of the DFlash2 drafter, which wins
    #   here, has rank 256 over the same 8,192 tokens: the head's capacity may be what DSpark lacks)
    "dspark+r256": [
        "--drafter.arch=dspark",
        "--drafter.block_size={dspark_block}",
        "--drafter.markov_rank=256",
        "--objective.weights=dpace",
    ],
    # - the same, the confidence loss also training the backbone and the Markov head (DeepSpec's)
    "dspark+joint": [*DSPARK, "--objective.weights=dpace", "--objective.confidence_detach=false"],
    # - DeepSpec's objective: 0.1 CE + 0.9 L1 to the target's softmax, gamma decay, the confidence
    #   taught 1 - TV, jointly
    "dspark+soft": [
        *DSPARK,
        "--objective.weights=gamma",
        "--targets.soft=dspark",
        "--objective.confidence_label=tv",
        "--objective.confidence_detach=false",
    ],
    # not at equal steps: 4x the optimiser steps over the same data (a recipe knob, reported apart)
    "batch4k": ["--data.batch_tokens=4096"],
    # DFlash2 (convolutions around every sublayer, a candidate selector over each position's
    # top-16), at equal data and steps, against `dpace` (the bar: tau >= 1.15x, step time <=
    # 1.25x). Its objective: D-PACE CE per position + the selector's K-way CE with the label
    # injected into the top-k when missing (speculators' trainer) or rows without it left out
    # (+strict, SpecForge's); D-PACE's confidence from the selector's probability (served), or the
    # unary softmax's (+unary_dpace)
    "dflash2": ["--drafter.arch=dflash2", "--objective.weights=dpace"],
    "dflash2+strict": [
        "--drafter.arch=dflash2",
        "--objective.weights=dpace",
        "--objective.selector_candidates=strict",
    ],
    "dflash2+unary_dpace": [
        "--drafter.arch=dflash2",
        "--objective.weights=dpace",
        "--objective.dpace_confidence=unary",
    ],
    # the recipe from a store of the same answers in another storage dtype (STORES): tau per codec
    "fp8": [],
    "q4": [],
    "dpace+q4": ["--objective.weights=dpace"],  # against dpace: the codec alone changes
    # every target layer captured and read by the drafter (its fc grows to N*H): at 4 bits they cost
    # less than DFlash's K layers in fp8 (benchmarks/store_codecs.py's bytes table); all_layers is
    # the bf16 twin
    "q4+all_layers": [],
    "all_layers": [],
    "dpace+q4+all_layers": ["--objective.weights=dpace"],  # against dpace and dpace+q4
    # the recipe from the same answers' text re-tokenised (dflash-generate's shards without their
    # answer_ids: what precompute stored before it kept them), against dpace
    "dpace+text": ["--objective.weights=dpace"],
}


class StoreSpec(NamedTuple):
    """What a training store holds: its storage dtype (None: the regime's, REGIMES), its layers
    (DFlash's K, or every layer) and whether dflash-generate's answers enter it as their text
    re-tokenised (their answer_ids dropped) rather than as the ids the target emitted."""

    dtype: str | None = None
    all_layers: bool = False
    text_answers: bool = False

    def name(self, split: str) -> str:
        """stores/<split>[-<dtype>][-all][-text]: 'train' and 'heldout' for the default."""
        return (
            split
            + (f"-{self.dtype}" if self.dtype else "")
            + ("-all" if self.all_layers else "")
            + ("-text" if self.text_answers else "")
        )


# stores/train: the regime's dtype, DFlash's layer ids, final states (soft targets)
DEFAULT_STORE = StoreSpec()
# Variants that train from another store than stores/train (a dtype equal to the regime's is
# stores/train itself: `store_spec`); the held-out store they are evaluated on is the regime's dtype
# with the same layers.
STORES: dict[str, StoreSpec] = {
    "fp8": StoreSpec("fp8_e4m3"),
    "q4": StoreSpec("q4_hadamard"),
    "dpace+q4": StoreSpec("q4_hadamard"),
    "q4+all_layers": StoreSpec("q4_hadamard", all_layers=True),
    "dpace+q4+all_layers": StoreSpec("q4_hadamard", all_layers=True),
    "all_layers": StoreSpec("bf16", all_layers=True),
    "dpace+text": StoreSpec(text_answers=True),
}

# The published DFlash recipe for the 8-layer target: block 16, layer ids by the DFlash rule (the
# store's), 3 draft layers, 6 epochs, AdamW 6e-4 cosine with 4% warmup, exp(-(k-1)/gamma) position
# weights (stated: dflash-train's default weights are D-PACE, the `dpace` variant).
RECIPE = [
    "--drafter.block_size=16",
    "--drafter.depth=3",
    "--optim.epochs=6",
    "--optim.lr=6e-4",
    "--objective.weights=gamma",
    "--data.batch_tokens=16384",
    "--data.cache_gb=5",
    "--data.holdout_sequences=256",
    "--validation.every_steps=500",
    "--checkpoint.every_steps=1000",
    "--log.every_steps=50",
    "--log.progress=false",
]
# Two regimes (--regime). "small": the 8.4M-parameter target, 5,000 training prompts, 6 epochs at
# 450 steps: a drafter that sees its data six times memorises it (held-out loss far above training
# loss). "rich": a stronger target (~36M parameters: hidden 512, 8 heads, SwiGLU 2048, 8 layers, so
# the DFlash layer ids stay [1..5]) on twice the corpus, ~5x the answer tokens (24,000 prompts), the
# same 450 steps of 16K tokens, which are then ~1.1 passes over the data: the regime real drafter
# training is in (~1B tokens, few epochs), where levers that regularise cannot pass for levers that
# learn. Its store is fp8 (half the disk of bf16, equal tau: docs/benchmarks.md) to fit the device's
# 64 GiB disk.
REGIMES: dict[str, dict] = {
    "small": {
        "target_args": "--compile --steps 1500 --corpus-mb 100",
        "train_prompts": 5000,
        "store_dtype": "bf16",
        "recipe": [],
    },
    "rich": {
        "target_args": "--compile --hidden 512 --heads 8 --kv-heads 4 --intermediate 2048 "
        "--steps 1500 --corpus-mb 200 --train-prompts 24000 --context-chars 400",
        "train_prompts": 24000,
        "store_dtype": "fp8_e4m3",
        "recipe": ["--optim.epochs=2", "--optim.max_steps=450"],
    },
}

TINY_RECIPE = [
    "--drafter.block_size=8",
    "--drafter.depth=1",
    "--optim.epochs=2",
    "--optim.lr=3e-3",
    "--objective.weights=gamma",
    "--data.batch_tokens=2048",
    "--data.cache_gb=0.05",
    "--data.holdout_sequences=8",
    "--data.window_shards=2",
    "--data.reader_threads=2",
    "--objective.max_anchors=32",
    "--precision.autocast=none",
    "--validation.every_steps=0",
    "--checkpoint.every_steps=1000",
    "--log.every_steps=5",
    "--log.progress=false",
    "--log.tensorboard=false",
]

# target.py's tiny mode (its docstring): < 1 min on 2 CPUs.
TINY_TARGET = [
    "--device",
    "cpu",
    "--corpus-mb",
    "2",
    "--bpe-train-mb",
    "2",
    "--vocab-size",
    "1024",
    "--hidden",
    "64",
    "--heads",
    "1",
    "--kv-heads",
    "1",
    "--intermediate",
    "128",
    "--seq-len",
    "128",
    "--batch",
    "8",
    "--steps",
    "20",
    "--warmup-steps",
    "2",
    "--eval-rows",
    "16",
    "--heldout-frac",
    "0.1",
    "--train-prompts",
    "50",
    "--heldout-prompts",
    "20",
    "--report-prompts",
    "8",
    "--max-new-tokens",
    "32",
    "--loop-window",
    "16",
]


def settings(args) -> dict:
    """What the cached artefacts depend on (not the variants or seeds, which have their own run
    dirs)."""
    return {
        "tiny": args.tiny,
        "regime": args.regime,
        "seed": args.target_seed,
        "max_new_tokens": args.max_new_tokens,
        "eval_prompts": args.eval_prompts,
        "train_prompts": args.train_prompts,
        "device": args.device,
    }


def env(threads: int | None = None) -> dict:
    """The children's environment; `threads` caps each child's CPU threads (OMP_NUM_THREADS, which
    torch takes for its intra-op pool) unless the caller's environment sets it."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else [])
    )
    if threads is not None:
        e.setdefault("OMP_NUM_THREADS", str(threads))
    return e


def launch(cmd: list[str], log: Path, threads: int | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    print("$", " ".join(cmd), f"> {log}", flush=True)
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env(threads), stdout=open(log, "w"), stderr=subprocess.STDOUT
    )


DEADLINE: float | None = (
    None  # time.time() after which running processes are stopped (--deadline-s)
)
STOP_GRACE_S = 30.0  # SIGTERM first, SIGKILL this long after


def wait_all(procs: list[tuple[subprocess.Popen, Path]], *, strict: bool = True) -> list[Path]:
    """Wait for side-by-side processes (stopping them at the deadline); the logs of those that
    failed. strict: one failure ends the benchmark naming its log (stages whose output every later
    one needs)."""
    for p, _ in procs:
        try:
            p.wait(timeout=None if DEADLINE is None else max(1.0, DEADLINE - time.time()))
        except subprocess.TimeoutExpired:
            # dflash-train saves a checkpoint at the end of its step: a rerun resumes it
            p.terminate()
            try:
                p.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    bad = [log for p, log in procs if p.returncode != 0]
    if bad:
        msg = (
            f"{len(bad)} process(es) failed or ran past the deadline; "
            f"see {', '.join(map(str, bad))}"
        )
        if strict:
            raise SystemExit(msg)
        print(msg, flush=True)
    return bad


def run_one(cmd: list[str], log: Path) -> None:
    wait_all([(launch(cmd, log), log)])


def matches(manifest: Path, want: dict) -> bool:
    return manifest.is_file() and json.loads(manifest.read_text()).get("settings") == want


def write_manifest(path: Path, want: dict, **extra) -> None:
    path.write_text(json.dumps({"settings": want, **extra}, indent=2) + "\n")


# ---------------------------------------------------------------- 1. target


def stage_target(args) -> None:
    cmd = [
        sys.executable,
        "benchmarks/quality/target.py",
        "--out",
        str(args.work / "target"),
        "--seed",
        str(args.target_seed),
    ]
    cmd += TINY_TARGET if args.tiny else ["--device", args.device]
    if args.target_minutes and not args.tiny:  # else target.py's own step count (or --target-args')
        cmd += ["--minutes", str(args.target_minutes)]
    cmd += (
        args.target_args
        if args.target_args is not None
        else ""
        if args.tiny
        else REGIMES[args.regime]["target_args"]
    ).split()
    run_one(cmd, args.work / "logs" / "target.log")


# ---------------------------------------------------------------- 2. data


def read_prompts(path: Path, limit: int) -> list[list[dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["messages"] for r in lines[: limit or None]]


def greedy_batched(
    model, prompts: list[list[int]], max_new: int, stops: frozenset[int], pad: int, batch: int
) -> list[list[int]]:
    """Greedy answers, left-padded batches through HF generate (training data: speed over
    bit-equality)."""
    import torch

    out, device = [], next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad little
    answers: dict[int, list[int]] = {}
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor(
            [[pad] * (width - len(prompts[i])) + prompts[i] for i in idx], device=device
        )
        mask = (
            torch.arange(width, device=device)[None]
            >= torch.tensor([width - len(prompts[i]) for i in idx], device=device)[:, None]
        ).long()
        with torch.inference_mode():
            gen = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=sorted(stops),
                pad_token_id=pad,
            )[:, width:].tolist()
        for i, row in zip(idx, gen):
            cut = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
            answers[i] = row[:cut]
    out = [answers[i] for i in range(len(prompts))]
    return out


def write_records(path: Path, prompts: list[list[int]], answers: list[list[int]]) -> None:
    with open(path, "w") as f:
        for i, (p, a) in enumerate(zip(prompts, answers)):
            f.write(
                json.dumps(
                    {
                        "id": f"{path.stem}-{i}",
                        "input_ids": p + a,
                        "loss_mask": [0] * len(p) + [1] * len(a),
                    }
                )
                + "\n"
            )


def start_generate(args, data: Path) -> subprocess.Popen:
    """dflash-generate answers the training prompts (greedy, float32) into data/generated/."""
    target = args.work / "target"
    prompts = data / "train_prompts.jsonl"
    lines = [
        line
        for line in (target / "prompts" / "train.jsonl").read_text().splitlines()
        if line.strip()
    ]
    prompts.write_text("\n".join(lines[: args.train_prompts or None]) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "precompute.generate.cli",
        f"--target.path={target}",
        "--target.dtype=fp32",
        f"--data.inputs={json.dumps([str(prompts)])}",
        "--sampling.temperature=0",
        f"--sampling.max_new_tokens={args.max_new_tokens}",
        f"--output.dir={data / 'generated'}",
        "--run.progress=false",
        f"--run.device={'cpu' if args.device == 'cpu' else 'auto'}",
    ]
    if args.tiny:
        cmd += ["--run.samples_per_unit=16", "--generate.token_budget=4096"]
    return launch(cmd, args.work / "logs" / "generate.log")


def train_answers(args, data: Path) -> str:
    """The training answers and heldout_prompts.jsonl (messages, for dflash-eval) in `data`:
    data/generated/ by dflash-generate (returned: "generated"), or train.jsonl token records by
    batched HF generate ("train.jsonl") when asked or when dflash-generate failed."""
    target, t0 = args.work / "target", time.perf_counter()
    with open(data / "heldout_prompts.jsonl", "w") as f:
        f.writelines(
            json.dumps({"messages": m}) + "\n"
            for m in read_prompts(target / "prompts" / "heldout.jsonl", args.eval_prompts)
        )
    if args.train_data == "generate":
        job = start_generate(args, data)
        try:
            if (
                job.wait(timeout=max(1.0, args.generate_timeout_s - (time.perf_counter() - t0)))
                == 0
            ):
                return "generated"
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
        print(
            f"dflash-generate failed or took over {args.generate_timeout_s:.0f} s "
            "(see logs/generate.log); "
            "training answers by batched HF generate instead",
            flush=True,
        )
    model, tok, stops, template = load_target(args)
    train = [
        template.prompt_ids(m)
        for m in read_prompts(target / "prompts" / "train.jsonl", args.train_prompts)
    ]
    answers = greedy_batched(model, train, args.max_new_tokens, stops, tok.pad_token_id, batch=256)
    write_records(data / "train.jsonl", train, answers)
    return "train.jsonl"


def load_target(args):
    """The target in float32 on the benchmark's device, its tokenizer, stop ids and chat
    template."""
    import torch

    from dflash_common.chat import ChatTemplate
    from dflash_common.hf import load_causal_lm, load_tokenizer, stop_token_ids

    target = args.work / "target"
    tok = load_tokenizer(target)
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    model = load_causal_lm(target, dtype="float32", device=device)
    return model, tok, stop_token_ids(model.generation_config, tok), ChatTemplate(tok, {})


def target_layers(args) -> list[int]:
    """Every decoder layer of the target: the layer ids of an all-layers store and drafter."""
    config = json.loads((args.work / "target" / "config.json").read_text())
    return list(range(config.get("text_config", config)["num_hidden_layers"]))


def precompute_command(
    args, records: Path, store: Path, spec: StoreSpec = DEFAULT_STORE
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "precompute.cli",
        "--out",
        str(store),
        f"--target.path={args.work / 'target'}",
        # final states for the soft-target variants
        f"--store.final_state={'true' if store.name == 'train' else 'false'}",
        f"--data.inputs={json.dumps([str(records)])}",
        "--target.dtype=fp32",
        f"--store.dtype={spec.dtype or base_dtype(args)}",
        "--data.block_size=2",
        "--data.max_length=4096",
        "--run.progress=false",
        f"--run.device={'cpu' if args.device == 'cpu' else 'auto'}",
    ]
    if spec.all_layers:
        cmd.append(f"--target.layer_ids={json.dumps(target_layers(args))}")
    return cmd


def precompute(
    args, records: Path, store: Path, spec: StoreSpec = DEFAULT_STORE
) -> subprocess.Popen:
    if spec.text_answers and records.is_dir():  # dflash-generate's shards
        from benchmarks.answer_tokens import without_ids

        records = without_ids(records, records.with_name(records.name + "-text"))
    elif spec.text_answers:
        print(f"{store}: the training answers are token records ({records.name}), not text: this "
              "store holds what stores/train holds")  # fmt: skip
    cmd = precompute_command(args, records, store, spec)
    if args.tiny:
        cmd += [
            "--run.samples_per_unit=16",
            "--batching.token_budget=4096",
            "--run.writer_threads=1",
        ]
    return launch(cmd, args.work / "logs" / f"precompute-{store.name}.log")


def data_settings(args) -> dict:
    target_manifest = (args.work / "target" / "manifest.json").read_bytes()
    return {**settings(args), "target": hashlib.sha256(target_manifest).hexdigest()}


def base_dtype(args) -> str:
    """The storage dtype of stores/train and stores/heldout: the regime's (bf16 when tiny)."""
    return "bf16" if args.tiny else REGIMES[args.regime]["store_dtype"]


def store_spec(args, variant: str) -> StoreSpec:
    """The training store of a variant; a dtype equal to the regime's is the default store's."""
    spec = STORES.get(variant, DEFAULT_STORE)
    return spec._replace(dtype=None) if spec.dtype == base_dtype(args) else spec


def build_stores(args, records: Path, want: dict, specs: list[tuple[str, StoreSpec]]) -> None:
    """Precompute the stores (name, spec) not yet made with these settings, side by side: each is
    one process on the one device, reading the same answers (a small target's forward leaves the
    device mostly idle, so two stores take about the time of one)."""
    todo = []
    for name, spec in specs:
        store = args.work / "stores" / name
        store_want = want if spec == DEFAULT_STORE else {**want, "store": spec._asdict()}
        if not matches(store / "bench_manifest.json", store_want):
            todo.append((precompute(args, records, store, spec), store, store_want))
    wait_all([(p, args.work / "logs" / f"precompute-{store.name}.log") for p, store, _ in todo])
    for _, store, store_want in todo:
        write_manifest(store / "bench_manifest.json", store_want)


def variant_stores(args) -> list[StoreSpec]:
    """The stores of the chosen variants other than the default, each once."""
    specs = (store_spec(args, v) for v in args.variants)
    return list(dict.fromkeys(s for s in specs if s != DEFAULT_STORE))


def training_stores(args) -> list[tuple[str, StoreSpec]]:
    """stores/train and the chosen variants' own training stores."""
    return [("train", DEFAULT_STORE)] + [
        (spec.name("train"), spec) for spec in variant_stores(args)
    ]


def stage_data(args) -> None:
    """The target answers the training prompts (dflash-generate), then the training stores: the
    default one and the chosen variants' own (another dtype, every layer), precomputed side by
    side."""
    data, want = args.work / "data", data_settings(args)
    if matches(data / "manifest.json", want):
        print(f"{data}: data with these settings is there; skipping")
    else:
        data.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        train_input = train_answers(args, data)
        write_manifest(
            data / "manifest.json",
            want,
            generate_s=round(time.perf_counter() - t0, 1),
            train_input=train_input,
        )
    records = data / json.loads((data / "manifest.json").read_text())["train_input"]
    build_stores(args, records, want, training_stores(args))


def heldout_batch_size(args) -> int:
    """The batch size dflash-eval picks here by default (generation.batch_size = 0)."""
    import torch

    from train.eval.batched import AUTO_ROWS

    return AUTO_ROWS if torch.cuda.is_available() and args.device != "cpu" else 1


def stage_heldout(args) -> None:
    """The held-out prompts answered by dflash-eval's own baseline loop (float32) as dflash-eval
    runs it on this device (batched on a GPU), so path tau replays exactly what dflash-eval's
    target emits here; then the held-out store. Answers made the other way (another batch size)
    are made again."""
    import torch

    from train.eval.run import target_answers

    data, want = args.work / "data", data_settings(args)
    want = {k: v for k, v in want.items() if k not in ("device", "train_prompts")}
    want["batch_size"] = heldout_batch_size(args)
    if not matches(data / "heldout_manifest.json", want):
        model, _, stops, template = load_target(args)
        held = [template.prompt_ids(m) for m in read_prompts(data / "heldout_prompts.jsonl", 0)]
        t0 = time.perf_counter()
        answers = target_answers(
            model,
            held,
            max_new_tokens=args.max_new_tokens,
            stop_ids=stops,
            batch_size=want["batch_size"],
            block_size=8 if args.tiny else 16,
        )
        write_records(data / "heldout.jsonl", held, answers)
        device = next(model.parameters()).device
        write_manifest(
            data / "heldout_manifest.json",
            want,
            device=str(device),
            device_name=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            seconds=round(time.perf_counter() - t0, 1),
        )
    else:
        made = json.loads((data / "heldout_manifest.json").read_text()).get("device_name")
        print(f"{data / 'heldout.jsonl'}: held-out answers made on {made} are there; keeping them")
    specs = dict.fromkeys(
        [DEFAULT_STORE] + [heldout_spec(args, v) for v in args.variants]
    )  # the runs' layers
    build_stores(
        args, data / "heldout.jsonl", want, [(spec.name("heldout"), spec) for spec in specs]
    )


# ---------------------------------------------------------------- 3. drafters


def run_dir(args, variant: str, seed: int) -> Path:
    return args.work / "runs" / variant / f"seed-{seed}"


def train_store(args, variant: str) -> Path:
    return args.work / "stores" / store_spec(args, variant).name("train")


def heldout_spec(args, variant: str) -> StoreSpec:
    """The held-out store a variant is evaluated on: the regime's dtype (every variant's offline
    figures on the same states), the layers its drafter reads."""
    return StoreSpec(None, store_spec(args, variant).all_layers)


def train_command(args, variant: str, seed: int) -> list[str]:
    out = run_dir(args, variant, seed)
    recipe = TINY_RECIPE if args.tiny else RECIPE + REGIMES[args.regime]["recipe"]
    block = int(next(a for a in recipe if a.startswith("--drafter.block_size=")).split("=")[1])
    layers = (
        [f"--drafter.layer_ids={json.dumps(target_layers(args))}"]
        if store_spec(args, variant).all_layers
        else []
    )
    return [
        sys.executable,
        "-m",
        "train.cli",
        f"--data.stores={json.dumps([str(train_store(args, variant))])}",
        f"--run.target={args.work / 'target'}",
        f"--run.out_dir={out}",
        f"--run.seed={seed}",
        f"--run.device={'cpu' if args.device == 'cpu' else 'auto'}",
        *recipe,
        *layers,
        *(a.format(dspark_block=block - 1) for a in VARIANTS[variant]),
    ]


def stage_drafters(args) -> None:
    # the training stores (the data stage makes them; here for variants added since)
    data = args.work / "data"
    records = data / json.loads((data / "manifest.json").read_text())["train_input"]
    build_stores(args, records, data_settings(args), training_stores(args))
    procs = []
    for variant in args.variants:
        for seed in args.seeds:
            out = run_dir(args, variant, seed)
            cmd = train_command(args, variant, seed)
            if matches(out / "bench_manifest.json", {"command": cmd[1:]}):
                continue
            procs.append((launch(cmd, out.parent / f"train-seed-{seed}.log"), out, cmd))
    wait_all(
        [(p, out.parent / f"train-seed-{out.name[5:]}.log") for p, out, _ in procs], strict=False
    )
    for p, out, cmd in procs:
        # a run stopped at the deadline has no drafter
        if p.returncode == 0 and (out / "drafter").is_dir():
            write_manifest(out / "bench_manifest.json", {"command": cmd[1:]})
    if procs and all(not (out / "drafter").is_dir() for _, out, _ in procs):
        raise SystemExit("every training run failed")


# ---------------------------------------------------------------- 4. eval


def heldout_store(args, out: Path) -> Path:
    return args.work / "stores" / heldout_spec(args, out.parent.name).name("heldout")


def eval_commands(args, out: Path) -> dict[str, list[str]]:
    """The reports of one run (out = runs/VARIANT/seed-S): offline_train reads the run's own
    training store (its trainer's held-out split), offline_heldout the held-out store of its
    layers."""
    target, data = args.work / "target", args.work / "data"
    common = [
        sys.executable,
        "-m",
        "train.eval.cli",
        "--drafter",
        str(out / "drafter"),
        f"--target.path={target}",
        f"--generation.max_new_tokens={args.max_new_tokens}",
        f"--target.device={'cpu' if args.device == 'cpu' else 'auto'}",
    ]
    return {
        "eval": common
        + [
            f"--prompts.files={json.dumps([str(data / 'heldout_prompts.jsonl')])}",
            "--target.dtype=float32",
            "--check.lossless=error",
            "--report",
            str(out / "eval.json"),
            # every run is evaluated on the same target and prompts: decode the target alone once
            f"--check.baseline_cache={args.work / 'baseline-cache'}",
        ],
        # the DSpark paper's protocol: temperature 1, drafts drawn from the drafter (DFlash2: its
        # greedy walk, the only proposal it has), one prompt at a time, the first 64 prompts
        "eval_t1": common
        + [
            f"--prompts.files={json.dumps([str(data / 'heldout_prompts.jsonl')])}",
            "--prompts.num_prompts=64",
            "--target.dtype=float32",
            "--generation.temperature=1.0",
            "--generation.draft_sampling="
            + ("greedy" if _arch(out) == "DFlash2DraftModel" else "probabilistic"),
            "--check.baseline=false",  # sampled: no greedy reference to compare against
            "--check.lossless=off",
            "--report",
            str(out / "eval_t1.json"),
        ],
        "offline_heldout": common
        + [
            "--offline",
            "--store",
            str(heldout_store(args, out)),
            "--offline.holdout_sequences=100000000",
            "--report",
            str(out / "offline_heldout.json"),
        ],
        "offline_train": common
        + [
            "--offline",
            "--store",
            str(train_store(args, out.parent.name)),
            "--report",
            str(out / "offline_train.json"),
        ],
    }


def _arch(out: Path) -> str:
    """The exported drafter's architecture (config.json's `architectures`, e.g.
    DFlash2DraftModel)."""
    config = out / "drafter" / "config.json"
    return json.loads(config.read_text())["architectures"][0] if config.is_file() else ""


EVALS = ("offline_heldout", "eval", "offline_train", "eval_t1")  # eval_commands' reports


def stage_eval(args) -> None:
    """Every run's reports, at most --parallel processes at a time, the quick offline figures
    first."""
    todo = []
    for name in args.evals:
        for variant in args.variants:
            for seed in args.seeds:
                out = run_dir(args, variant, seed)
                if name == "offline_heldout" and not heldout_store(args, out).is_dir():
                    continue  # no heldout stage yet
                if (out / "drafter").is_dir() and not (out / f"{name}.json").is_file():
                    todo.append(
                        (eval_commands(args, out)[name], out.parent / f"{name}-seed-{seed}.log")
                    )
    running: list[tuple[subprocess.Popen, Path]] = []
    done: list[tuple[subprocess.Popen, Path]] = []
    while todo or running:
        while (
            todo and len(running) < args.parallel and (DEADLINE is None or time.time() < DEADLINE)
        ):
            cmd, log = todo.pop(0)
            # the cores shared out: two evaluations each with every core's threads ran 10x slower
            # on 2 cores (OpenMP threads contending) than with one thread each
            running.append(
                (launch(cmd, log, threads=max(1, (os.cpu_count() or 1) // args.parallel)), log)
            )
        if not running:
            break  # the deadline passed before the rest could start
        time.sleep(0.5)
        finished = [(p, log) for p, log in running if p.poll() is not None]
        running = [(p, log) for p, log in running if p.poll() is None]
        done += finished
        if DEADLINE is not None and time.time() >= DEADLINE:
            break
    # stops what still runs at the deadline, names the failures
    wait_all(running + done, strict=False)


# ---------------------------------------------------------------- 5. table


def _report(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def one_run(out: Path) -> dict:
    """The figures of one training run, from its reports and metrics (None for a report not
    written)."""
    ev, held, train, hot = (
        _report(out / f"{n}.json") for n in ("eval", "offline_heldout", "offline_train", "eval_t1")
    )
    counts = {int(k): v for k, v in ev.get("histogram_counts", {}).items()}
    metrics = out / "metrics.jsonl"
    records = [
        json.loads(line)
        for line in (metrics.read_text().splitlines() if metrics.is_file() else [])
        if line.strip()
    ]
    trained = [r for r in records if r.get("kind") == "train"]
    tok_s = [r["tok_s"] for r in trained]
    val = [r for r in records if r.get("kind") == "val"]
    return {
        "tau": ev.get("tau"),
        "tau_pooled": sum(n * c for n, c in counts.items()) / sum(counts.values())
        if counts
        else None,
        "tau_t1": hot.get("tau"),
        "lossless": ev.get("lossless", {}).get("ok"),
        "prompts": ev.get("num_prompts"),
        "offline_train": train.get("tau"),
        "offline_heldout": held.get("tau"),
        "path_tau_heldout": held.get("path_tau"),
        "path_tau_pooled_heldout": held.get("path_tau_pooled"),
        "path_tau_train": train.get("path_tau"),
        "val_path_tau": val[-1].get("path_tau") if val else None,
        "val_tau": val[-1].get("tau") if val else None,
        # where dflash-eval decoded: "cuda:0, batches of up to 256" or "cpu, one at a time"
        "eval_on": _decoded_on(ev),
        "tok_s": statistics.fmean(tok_s[1:] or tok_s) if tok_s else None,
        **generalisation(trained[-1] if trained else {}, val[-1] if val else {}),
    }


def generalisation(last_train: dict, last_val: dict) -> dict:
    """How the held-out split compares with the training data at the end of a run: held-out CE
    over training CE (every block position alike in both: the `ce` of the records; None in runs
    from before it) and training accuracy less held-out accuracy. About 1 and 0 for a drafter that
    generalises; a memorising one has a ratio well above 1 and a positive gap."""
    ce = last_train.get("ce"), last_val.get("ce")
    acc = last_train.get("acc"), last_val.get("acc")
    return {
        "ce_ratio": ce[1] / ce[0] if None not in ce and ce[0] else None,
        "acc_gap": acc[0] - acc[1] if None not in acc else None,
    }


def _decoded_on(report: dict) -> str | None:
    if not report:
        return None
    batch = report.get("batch_size", 1)
    how = "one at a time" if batch == 1 else f"batches of up to {batch}"
    return f"{report.get('device')}, {how}"


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _ms(xs: list[float | None]) -> str:
    """mean ± sd of the values present; '(k of n)' when some seeds have none."""
    have = [x for x in xs if x is not None]
    if not have:
        return "n/a"
    big = statistics.fmean(have) >= 1000  # tok/s
    mean, sd = statistics.fmean(have), statistics.stdev(have) if len(have) > 1 else None
    text = f"{mean:,.0f}" if big else f"{mean:.3f}"
    if sd is not None:
        text += f" ± {sd:,.0f}" if big else f" ± {sd:.3f}"
    return text + (f" ({len(have)} of {len(xs)})" if len(have) < len(xs) else "")


COLUMNS = [
    ("tau", "tau (dflash-eval)"),
    ("tau_pooled", "pooled tau"),
    ("tau_t1", "tau at temperature 1, drawn drafts (64 prompts)"),
    ("path_tau_heldout", "path tau (held-out)"),
    ("path_tau_pooled_heldout", "pooled path tau"),
    ("offline_heldout", "offline est. (held-out)"),
    ("val_tau", "offline est. (train split, trainer's last validation)"),
    ("val_path_tau", "path tau (train split, trainer's last validation)"),
    ("offline_train", "offline est. (train split, dflash-eval)"),
    ("ce_ratio", "held-out / train CE (last)"),
    ("acc_gap", "train - held-out acc (last)"),
    ("tok_s", "trainer tok/s"),
]


def stage_table(args) -> None:
    results = {v: {s: one_run(run_dir(args, v, s)) for s in args.seeds} for v in args.variants}
    lines = [
        "| variant | seeds | lossless | tau vs baseline | "
        + " | ".join(label for _, label in COLUMNS)
        + " |",
        "|---|---|---|---|" + "---|" * len(COLUMNS),
    ]
    base = _mean([r["tau"] for r in results.get("baseline", {}).values()])
    for v, runs in results.items():
        evaluated = [r["lossless"] for r in runs.values() if r["lossless"] is not None]
        ok = "n/a" if not evaluated else "yes" if all(evaluated) else "NO"
        tau = _mean([r["tau"] for r in runs.values()])
        ratio = f"{tau / base:.3f}" if tau is not None and base else "n/a"
        cells = [_ms([r[k] for r in runs.values()]) for k, _ in COLUMNS]
        lines.append(f"| {v} | {len(runs)} | {ok} | {ratio} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    per_seed = [
        "",
        "| variant | seed | tau | pooled tau | path tau (held-out) | offline est. (held-out) "
        "| tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, runs in results.items():
        for seed, r in runs.items():
            per_seed.append(
                f"| {v} | {seed} | "
                + " | ".join(
                    "n/a" if r[k] is None else f"{r[k]:.3f}" if k != "tok_s" else f"{r[k]:,.0f}"
                    for k in ("tau", "tau_pooled", "path_tau_heldout", "offline_heldout", "tok_s")
                )
                + " |"
            )
    where = sorted(
        {r["eval_on"] for runs in results.values() for r in runs.values() if r["eval_on"]}
    )
    (args.work / "results.md").write_text(
        table + "\n\nmean ± sd over seeds; tau per prompt then over prompts (the DFlash authors' "
        "way), pooled = tokens per cycle over all cycles; "
        f"dflash-eval decoded on {' and '.join(where) or 'n/a'}.\n" + "\n".join(per_seed) + "\n"
    )
    (args.work / "results.json").write_text(
        json.dumps({"settings": settings(args), "runs": results}, indent=2)
    )


# ---------------------------------------------------------------- main

STAGES = {
    "target": stage_target,
    "data": stage_data,
    "heldout": stage_heldout,
    "drafters": stage_drafters,
    "eval": stage_eval,
    "table": stage_table,
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--work", type=Path, required=True, help="directory of every artefact (cached per stage)"
    )
    p.add_argument("--stage", default="all", choices=["all", *STAGES])
    p.add_argument("--variants", default="baseline", help=f"comma-separated, of {sorted(VARIANTS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    p.add_argument(
        "--tiny", action="store_true", help="tiny sizes on the CPU: the whole chain in minutes"
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--target-seed", type=int, default=0)
    p.add_argument(
        "--target-minutes", type=float, default=0, help="target training time (0: its --steps)"
    )
    p.add_argument(
        "--train-prompts",
        type=int,
        default=None,
        help="training prompts answered (default: the regime's; 0: all)",
    )
    p.add_argument(
        "--eval-prompts", type=int, default=256, help="held-out prompts (dflash-eval and path tau)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=256, help="answer length limit, generation and eval"
    )
    p.add_argument(
        "--regime",
        default="small",
        choices=sorted(REGIMES),
        help="small: today's 8.4M target, 5,000 prompts, 6 epochs; rich: a ~36M target, 24,000 "
        "prompts, ~1 epoch at the same steps (REGIMES in this file)",
    )
    p.add_argument(
        "--target-args",
        default=None,
        help="target.py arguments instead of the regime's, e.g. '--compile --steps 2000'",
    )
    p.add_argument(
        "--train-data",
        default="generate",
        choices=["generate", "hf"],
        help="training answers by dflash-generate (conversations with their answers' token ids) "
        "or by batched HF generate (token records); generate falls back to hf if it fails",
    )
    p.add_argument("--parallel", type=int, default=16, help="evaluation processes at a time")
    p.add_argument(
        "--evals",
        default="offline_heldout,eval,offline_train",
        help="the eval stage's reports, in this order: offline_heldout (path tau and the estimate "
        "on the held-out store), eval (dflash-eval), offline_train (the training store's split), "
        "eval_t1 (dflash-eval at temperature 1 with drafts drawn from the drafter, the DSpark "
        "paper's protocol, 64 prompts one at a time; not by default)",
    )
    p.add_argument(
        "--generate-timeout-s",
        type=float,
        default=1e9,
        help="fall back to batched HF generate if dflash-generate takes longer than this",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=0,
        help="stop the processes still running this many seconds after the start (0: never); the "
        "table then reports what finished",
    )
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; define them in VARIANTS in {__file__}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.train_prompts is None:
        args.train_prompts = REGIMES[args.regime]["train_prompts"]
    args.evals = [e for e in args.evals.split(",") if e]
    if set(args.evals) - set(EVALS):
        p.error(f"--evals: unknown report(s) {sorted(set(args.evals) - set(EVALS))}")
    if args.tiny:  # dflash-generate's answers as their ids: its plumbing on a CPU too
        args.device, args.eval_prompts, args.max_new_tokens = "cpu", min(args.eval_prompts, 8), 32
    args.work = args.work.resolve()
    global DEADLINE
    DEADLINE = time.time() + args.deadline_s if args.deadline_s else None
    return args


def main(argv=None) -> None:
    args = parse(argv)
    for name, stage in STAGES.items():
        if args.stage in ("all", name):
            t0 = time.perf_counter()
            stage(args)
            print(f"stage {name}: {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
