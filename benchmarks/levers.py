"""What each training lever of issue 17 costs in speed: the trainer's own optimiser step
(train.loop.train_step: forward, fused loss, backward, clip, AdamW, EMA) on one resident batch, once
per variant of `--objective.*` / `--regularise.*` overrides, against today's recipe.

    PYTHONPATH=. python benchmarks/levers.py            # GPU: Qwen3-8B-shaped drafter, bf16 autocast
    PYTHONPATH=. python benchmarks/levers.py --quick    # CPU smoke run, tiny drafter
    PYTHONPATH=. python benchmarks/levers.py --variant "--objective.weights=dpace --objective.dpace_alpha=0.3"

Random weights and random context features; each sequence is a 10% prompt and a 90% response, so the
anchor rules differ only at the end of each response (as in real data). Prints a table: variant,
median step time with its spread (lowest-highest step), context tok/s, and the ratio of the medians to
the recipe's (1.00 = free).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.drafter_step import qwen3_8b_drafter, tiny_drafter  # noqa: E402
from benchmarks.timing import Spread, wall_times  # noqa: E402
from dflash_common.config import load_config  # noqa: E402
from dflash_common.drafter.model import DFlashDrafter  # noqa: E402
from dflash_common.drafter.objective import sample_anchors  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.loop import _N, train_step  # noqa: E402
from train.optim import build_optimizer  # noqa: E402
from train.regularise import WeightAverage  # noqa: E402
from train.transfer import DeviceBatch  # noqa: E402

VARIANTS = ["", "--objective.anchors=label", "--objective.weights=dpace", "--objective.normalise=anchors",
            "--objective.gamma=4", "--objective.path_weight=1", "--objective.weights=dpace --objective.path_weight=1",
            "--regularise.noise=0.05", "--regularise.ema=0.999",
            "--objective.anchors=label --objective.weights=dpace --objective.normalise=anchors "
            "--objective.path_weight=1 --regularise.noise=0.05 --regularise.ema=0.999"]


def make_batch(cfg, seqs: int, seq_len: int, anchors_per_seq: int, rule: str, device) -> DeviceBatch:
    g = torch.Generator().manual_seed(0)
    total = seqs * seq_len
    features = torch.randn(total, cfg.num_context_layers * cfg.hidden_size, generator=g)
    input_ids = torch.randint(0, cfg.vocab_size, (total,), generator=g)
    cu = torch.arange(0, total + 1, seq_len)
    loss_mask = (torch.arange(total) % seq_len) >= seq_len // 10  # prompt 10%, response 90%
    anchors = sample_anchors(loss_mask, cu, cfg.block_size, anchors_per_seq, g, rule)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return DeviceBatch(features.to(device, dtype), input_ids.to(device), loss_mask.to(device),
                       cu.to(device), anchors.to(device), total, 0, 0, {}, 0.0)


def time_variant(variant: str, dcfg, args, device) -> Spread:
    """Seconds of one optimiser step under `variant`'s overrides: median and spread of the steps."""
    cuda = device.type == "cuda"
    # the paper's recipe stated (dflash-train's default weights are D-PACE): each variant's overrides come after
    overrides = [f"--precision.autocast={'bf16' if cuda else 'none'}", "--optim.grad_accum=1",
                 "--objective.weights=gamma", *shlex.split(variant)]
    cfg = load_config(TrainConfig, None, overrides)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg).to(device)
    v, h = dcfg.vocab_size, dcfg.hidden_size
    drafter.attach_frozen(torch.randn(v, h, device=device, dtype=torch.bfloat16),
                          torch.randn(v, h, device=device, dtype=torch.bfloat16) * h**-0.5)
    optimizer, scheduler = build_optimizer(cfg.optim, drafter, total=10**6, device=device)
    ema = WeightAverage(drafter, cfg.regularise.ema) if cfg.regularise.ema > 0 else None
    batch = make_batch(dcfg, args.seqs, args.seq_len, args.anchors, cfg.objective.anchors, device)
    sums = torch.zeros(_N + 1, dtype=torch.float64, device=device)
    counts = torch.zeros(2 * dcfg.block_size + 2, dtype=torch.float64, device=device)

    def step():
        fresh = DeviceBatch(**{**batch.__dict__, "features": batch.features.clone()})  # noise works in place
        train_step(drafter, drafter, iter([fresh]), optimizer, scheduler, cfg, sums, counts, ema)

    return Spread.of(wall_times(step, args.steps, args.warmup, cuda))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny drafter on the CPU (smoke test)")
    parser.add_argument("--seqs", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    parser.add_argument("--variant", action="append", help="overrides of one variant (repeatable); "
                        "default: each lever alone and all together")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dcfg = qwen3_8b_drafter() if not args.quick else tiny_drafter()
    if args.quick:
        args.seq_len, args.anchors, args.steps, args.warmup = 256, 16, 5, 1
    variants = [""] + [v for v in (args.variant or VARIANTS) if v]
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"# one optimiser step per lever on {name}: {dcfg.num_hidden_layers} layers, hidden {dcfg.hidden_size}, "
          f"vocab {dcfg.vocab_size}, {args.seqs} x {args.seq_len} tokens, up to {args.anchors} anchors per sequence")
    print(f"| {'variant':<60} | {'step ms [lowest-highest]':>26} | {'tok/s':>10} | {'vs recipe':>9} |")
    print(f"|{'-' * 62}|{'-' * 28}|{'-' * 12}|{'-' * 11}|")
    base = None
    for variant in variants:
        seconds = time_variant(variant, dcfg, args, device)
        base = base or seconds.median
        print(f"| {variant or '(recipe)':<60} | {seconds.scaled(1e3).text():>26} "
              f"| {args.seqs * args.seq_len / seconds.median:>10,.0f} | {base / seconds.median:>9.2f} |")


if __name__ == "__main__":
    main()
