"""Soft-target loss, forward + backward, against the hard fused loss it extends.

    PYTHONPATH=. python benchmarks/soft_loss.py            # on a GPU: the goal sizes, bf16, Triton
    PYTHONPATH=. python benchmarks/soft_loss.py --quick    # CPU, tiny sizes, torch backend

Rows: the hard fused loss (loss/hard.py; 4NVH), then each soft kind (loss/soft.py; the target's
logits are one more matmul per chunk: 6NVH): 'ce' with greedy labels (what prompt anchors cost with
targets.soft=none), 'kl', 'tv', 'dspark'. Every row carries DFlash block weights (1 in 16 skipped).
Time is the median over repetitions (CUDA events on a GPU), with their spread; peak memory (GPU
only) is the largest allocation above the inputs over one forward + backward: it must stay near the
hard loss's (no [N, V] tensor), since both chunk by the same byte budget.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.loss import GOAL_SIZES, QUICK_SIZES, make_inputs, measure  # noqa: E402
from dflash_common.drafter.loss import fused_lm_head_loss, soft_lm_head_loss  # noqa: E402


def hard(backend):
    def run(hidden, weight, labels, weights, teacher, index):
        return fused_lm_head_loss(hidden, weight, labels, weights, backend=backend).loss

    return run


def soft(kind, backend):
    def run(hidden, weight, labels, weights, teacher, index):
        return soft_lm_head_loss(
            hidden, weight, labels, weights, teacher, index, kind, backend=backend
        ).loss

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (smoke test)")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "triton" if device.type == "cuda" else "torch"
    sizes, reps = (QUICK_SIZES, 3) if args.quick else (GOAL_SIZES, args.reps)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"# LM-head loss forward+backward on {name}, {str(dtype).removeprefix('torch.')}, "
        f"{backend}, median of {reps}"
    )
    print(
        f"| {'loss':<28} | {'N, H, V':<20} | {'ms':>9} | {'spread ms':>15} | {'x hard':>7} "
        f"| {'peak GiB':>9} |"
    )
    print(f"|{'-' * 30}|{'-' * 22}|{'-' * 11}|{'-' * 17}|{'-' * 9}|{'-' * 11}|")
    rows = [("hard CE (fused_lm_head_loss)", hard(backend))]
    rows += [(f"soft {kind}", soft(kind, backend)) for kind in ("ce", "kl", "tv", "dspark")]
    for n, h, v in sizes:
        hidden, weight, labels, weights = make_inputs(n, h, v, device, dtype, block_weights=True)
        # the target's final states, one per row
        teacher = torch.randn(n, h, device=device, dtype=dtype)
        index = torch.arange(n, device=device)
        base = None
        for label, fn in rows:
            try:
                ms, peak, (lo, hi) = measure(
                    fn, (hidden, weight, labels, weights, teacher, index), reps
                )
            except torch.OutOfMemoryError:
                print(
                    f"| {label:<28} | {f'{n}, {h}, {v}':<20} | {'OOM':>9} | {'':>15} | {'':>7} "
                    f"| {'OOM':>9} |"
                )
                continue
            base = base or ms
            peak_text = "n/a" if peak is None else f"{peak:.2f}"
            print(
                f"| {label:<28} | {f'{n}, {h}, {v}':<20} | {ms:>9.1f} | {f'{lo:.1f}-{hi:.1f}':>15} "
                f"| {ms / base:>7.2f} | {peak_text:>9} |"
            )
        del hidden, weight, teacher
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
