"""What each training lever of issue 17 costs in speed: the trainer's own optimiser step
(train.loop.train_step: forward, fused loss, backward, clip, AdamW, EMA) on one resident batch, once
per variant of `--objective.*` / `--regularise.*` overrides, against the paper's recipe.

    PYTHONPATH=. python benchmarks/levers.py           # GPU: Qwen3-8B-shaped drafter, bf16 autocast
    PYTHONPATH=. python benchmarks/levers.py --quick   # CPU smoke run, tiny drafter
    PYTHONPATH=. python benchmarks/levers.py \\
        --variant "--objective.weights=dpace --objective.dpace_alpha=0.3"
    PYTHONPATH=. python benchmarks/levers.py --dspark  # DSpark against DFlash, both under D-PACE
    PYTHONPATH=. python benchmarks/levers.py --dspark --small   # the same on a CPU-sized drafter
    PYTHONPATH=. python benchmarks/levers.py --dflash2 # DFlash2 against DFlash, both under D-PACE

Random weights and random context features; each sequence is a 10% prompt and a 90% response, so the
anchor rules differ only at the end of each response (as in real data). Prints a table: variant,
median step time with its spread (lowest-highest step), context tok/s, and the ratio of the medians
to the recipe's (1.00 = free). A variant may set `--drafter.arch=dspark` and its heads (the
drafter's sizes stay the benchmark's; its block is one shorter, so it drafts as many tokens as
DFlash's; its Markov rank is hidden / 16, DeepSpec's 256 at hidden 4096, unless a variant sets it),
or `--drafter.arch=dflash2` (DFlash's block; its convolutions and selector as the variant's
`--drafter.conv_*` / `--drafter.selector_*` say, the defaults otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.drafter_step import qwen3_8b_drafter, tiny_drafter  # noqa: E402
from benchmarks.timing import Spread, wall_times  # noqa: E402
from dflash_common.config import load_config  # noqa: E402
from dflash_common.drafter.arch import config_class, new_drafter  # noqa: E402
from dflash_common.drafter.objective import sample_anchors  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.loop import _N, train_step  # noqa: E402
from train.optim import build_optimizer  # noqa: E402
from train.regularise import WeightAverage  # noqa: E402
from train.transfer import DeviceBatch  # noqa: E402

VARIANTS = [
    "",
    "--objective.anchors=label",
    "--objective.weights=dpace",
    "--objective.normalise=anchors",
    "--objective.gamma=4",
    "--objective.path_weight=1",
    "--objective.weights=dpace --objective.path_weight=1",
    "--regularise.noise=0.05",
    "--regularise.ema=0.999",
    "--objective.anchors=label --objective.weights=dpace --objective.normalise=anchors "
    "--objective.path_weight=1 --regularise.noise=0.05 --regularise.ema=0.999",
]
# --dspark: DFlash (B=16, 15 drafts) against DSpark drafting as many (B=15), all under D-PACE; then
# DSpark's parts one by one: no confidence head, the confidence trained jointly, DeepSpec's mix
DSPARK = "--objective.weights=dpace --drafter.arch=dspark"
DSPARK_VARIANTS = [
    "--objective.weights=dpace",
    DSPARK,
    f"{DSPARK} --drafter.confidence_head=false",
    f"{DSPARK} --objective.confidence_detach=false",
    f"{DSPARK} --targets.soft=dspark --objective.confidence_label=tv "
    "--objective.confidence_detach=false",
]
# --dflash2: DFlash against DFlash2 (the same block), all under D-PACE; then DFlash2's parts: its
# selector untrained (selector_weight 0: the walk still runs, the served path's correctness needs
# it; no selector backward), a wider selector (top-32), one more tap
DFLASH2 = "--objective.weights=dpace --drafter.arch=dflash2"
DFLASH2_VARIANTS = [
    "--objective.weights=dpace",
    DFLASH2,
    f"{DFLASH2} --objective.selector_weight=0",
    f"{DFLASH2} --drafter.selector_top_k=32",
    f"{DFLASH2} --drafter.conv_kernel_size=3",
]


def small_drafter():
    """Hidden 512, vocab 32768, 2 layers, B = 16: a step of seconds on a CPU."""
    return dataclasses.replace(
        tiny_drafter(),
        hidden_size=512,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=32768,
        mask_token_id=32000,
        block_size=16,
        layer_types=("full_attention",) * 2,
        sliding_window=None,
    )


def drafter_for(cfg: TrainConfig, dcfg):
    """The benchmark's drafter shape with the variant's arch and heads; a DSpark drafter gets a
    block one shorter, so that it drafts as many tokens a cycle (its anchor row predicts too)."""
    d = cfg.drafter
    fields = {f.name: getattr(dcfg, f.name) for f in dataclasses.fields(dcfg) if f.name != "arch"}
    if d.arch == "dspark":
        # the default rank scales with the width: 256 at hidden 4096
        rank = d.markov_rank if d.markov_rank != 256 else max(1, dcfg.hidden_size // 16)
        fields.update(
            block_size=dcfg.block_size - 1,
            markov_rank=rank,
            confidence_head=d.confidence_head,
            confidence_head_with_markov=d.confidence_head_with_markov,
        )
    if d.arch == "dflash2":
        fields.update(
            conv_kernel_size=d.conv_kernel_size,
            conv_group_size=d.conv_group_size,
            selector_rank=d.selector_rank,
            selector_top_k=d.selector_top_k,
        )
    return config_class(d.arch)(**fields)


def make_batch(
    cfg, seqs: int, seq_len: int, anchors_per_seq: int, rule: str, device, final: bool = False
) -> DeviceBatch:
    g = torch.Generator().manual_seed(0)
    total = seqs * seq_len
    features = torch.randn(total, cfg.num_context_layers * cfg.hidden_size, generator=g)
    input_ids = torch.randint(0, cfg.vocab_size, (total,), generator=g)
    cu = torch.arange(0, total + 1, seq_len)
    loss_mask = (torch.arange(total) % seq_len) >= seq_len // 10  # prompt 10%, response 90%
    anchors = sample_anchors(loss_mask, cu, cfg.verify_block_size, anchors_per_seq, g, rule)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    states = torch.randn(total, cfg.hidden_size, generator=g).to(device, dtype) if final else None
    return DeviceBatch(
        features.to(device, dtype),
        input_ids.to(device),
        loss_mask.to(device),
        cu.to(device),
        anchors.to(device),
        total,
        0,
        0,
        {},
        0.0,
        states,
    )


def make_step(variant: str, dcfg, args, device):
    """One optimiser step under `variant`'s overrides: own drafter, optimiser, resident batch."""
    cuda = device.type == "cuda"
    # the paper's recipe stated (dflash-train's default weights are D-PACE): each variant's
    # overrides come after
    overrides = [
        f"--precision.autocast={'bf16' if cuda else 'none'}",
        "--optim.grad_accum=1",
        "--objective.weights=gamma",
        *shlex.split(variant),
    ]
    cfg = load_config(TrainConfig, None, overrides)
    dcfg = drafter_for(cfg, dcfg)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains: ~1B parameters on a CPU take ~20 s
        drafter = new_drafter(dcfg)
    v, h = dcfg.vocab_size, dcfg.hidden_size
    head_dtype = torch.bfloat16 if cuda else torch.float32  # as the trainer: bf16 under autocast
    drafter.attach_frozen(
        torch.randn(v, h, device=device, dtype=head_dtype),
        torch.randn(v, h, device=device, dtype=head_dtype) * h**-0.5,
    )
    optimizer, scheduler = build_optimizer(cfg.optim, drafter, total=10**6, device=device)
    ema = WeightAverage(drafter, cfg.regularise.ema) if cfg.regularise.ema > 0 else None
    batch = make_batch(
        dcfg,
        args.seqs,
        args.seq_len,
        args.anchors,
        cfg.objective.anchors,
        device,
        final=cfg.targets.needs_final_state,
    )
    sums = torch.zeros(_N + 1, dtype=torch.float64, device=device)
    counts = torch.zeros(2 * dcfg.verify_block_size + 2, dtype=torch.float64, device=device)

    def step():
        # noise works in place
        fresh = DeviceBatch(**{**batch.__dict__, "features": batch.features.clone()})
        train_step(drafter, drafter, iter([fresh]), optimizer, scheduler, cfg, sums, counts, ema)

    return step


def time_variants(variants: list[str], dcfg, args, device) -> dict[str, Spread]:
    """Each variant's step times: one variant after the other (every drafter in memory only while
    it is timed: an 8B-shaped one at a time), or with --interleave round by round (all in memory; a
    slow spell of a shared machine then hits every variant alike)."""
    cuda = device.type == "cuda"
    clock = time.process_time if args.cpu_time else time.perf_counter
    if not args.interleave:
        return {
            v: Spread.of(
                wall_times(make_step(v, dcfg, args, device), args.steps, args.warmup, cuda, clock)
            )
            for v in variants
        }
    steps = {v: make_step(v, dcfg, args, device) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for v, step in steps.items():
        wall_times(step, 0, args.warmup, cuda)
    for _ in range(args.steps):
        for v, step in steps.items():
            times[v] += wall_times(step, 1, 0, cuda, clock)
    if args.profile:
        _profile(steps)
    return {v: Spread.of(t) for v, t in times.items()}


def _profile(steps: dict) -> None:
    """Per variant, the operators that took the most time in two steps (torch.profiler, CPU)."""
    from torch.profiler import ProfilerActivity, profile

    for variant, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
            step()
        print(f"\n## {variant or '(recipe)'}: two steps, operators by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny drafter on the CPU (smoke test)")
    parser.add_argument("--seqs", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    parser.add_argument(
        "--variant",
        action="append",
        help="overrides of one variant (repeatable); default: each lever alone and all together",
    )
    parser.add_argument(
        "--dspark", action="store_true", help="the DSpark variants (DSPARK_VARIANTS)"
    )
    parser.add_argument(
        "--dflash2", action="store_true", help="the DFlash2 variants (DFLASH2_VARIANTS)"
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="time the variants step by step in turn, all in memory (shared machines)",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="CPU only: time each step by the process's CPU seconds (other jobs on a shared "
        "machine do not inflate them; run with OMP_NUM_THREADS=1)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="with --interleave: each variant's top operators"
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="a drafter sized for a CPU (hidden 512, vocab 32768, 2 layers, 1024 "
        "tokens, 128 anchors), its loss weighing in the step as an 8B drafter's",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick and not args.cpu_time
    device = torch.device("cuda" if cuda else "cpu")
    dcfg = tiny_drafter() if args.quick else small_drafter() if args.small else qwen3_8b_drafter()
    if args.quick:
        args.seq_len, args.anchors, args.steps, args.warmup = 256, 16, 5, 1
    if args.small:
        args.seq_len, args.anchors, args.steps, args.warmup = 1024, 128, 5, 1
    chosen = args.variant or (
        DSPARK_VARIANTS if args.dspark else DFLASH2_VARIANTS if args.dflash2 else VARIANTS
    )
    variants = [""] + [v for v in chosen if v]
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(
        f"# one optimiser step per lever on {name}: {dcfg.num_hidden_layers} layers, "
        f"hidden {dcfg.hidden_size}, vocab {dcfg.vocab_size}, {args.seqs} x {args.seq_len} tokens, "
        f"up to {args.anchors} anchors per sequence"
    )
    what = "CPU ms" if args.cpu_time else "step ms"
    print(
        f"| {'variant':<60} | {what + ' [lowest-highest]':>26} | {'tok/s':>10} | {'vs recipe':>9} |"
    )
    print(f"|{'-' * 62}|{'-' * 28}|{'-' * 12}|{'-' * 11}|")
    base = None
    for variant, seconds in time_variants(variants, dcfg, args, device).items():
        base = base or seconds.median
        print(
            f"| {variant or '(recipe)':<60} | {seconds.scaled(1e3).text():>26} "
            f"| {args.seqs * args.seq_len / seconds.median:>10,.0f} "
            f"| {base / seconds.median:>9.2f} |"
        )


if __name__ == "__main__":
    main()
