"""One full drafter training step: forward, fused loss, backward, grad clip and AdamW step (the
trainer's clip_and_step: a fused AdamW takes the clip factor as its grad_scale).

    PYTHONPATH=. python benchmarks/drafter_step.py  # GPU: Qwen3-8B-shaped drafter, bf16 autocast
    PYTHONPATH=. python benchmarks/drafter_step.py --quick  # CPU smoke run, tiny drafter
    PYTHONPATH=. python benchmarks/drafter_step.py --variants eager,dflash2  # DFlash vs DFlash2

Variants: eager (the DFlash step, flex compiled, the rest eager), compiled (precision.compile),
dflash2 (the DFlash2 drafter of the same shape, released geometry: 2 taps, group 16, rank 256,
top-16; its step adds the convolutions, the fused loss's top-k and the selector loss, as
train/objective.py runs them) and dflash2-compiled. The FLOP count and MFU are DFlash's (the DFlash2
extras are not counted).

Qwen3-8B shape: hidden 4096, 32 heads, 8 kv heads, head_dim 128, intermediate 12288, 5 layers,
vocab 151936, K=5 target layers, B=16; per sequence of 3072 tokens, 512 anchors (all positions are
response tokens here). Random weights; flex attention compiled (the drafter does so on CUDA).

FLOPs counted per step (T context tokens, Q = A*B block rows, P_l visible query-key pairs of layer
l from the sparse mask, N_loss rows with non-zero weight; Hq = heads*D, Hkv = kv_heads*D):
    fc                     4 * T * K*H * H              (forward + weight grad; features need none)
    context K/V, per layer 3 * 2 * T * H * 2*Hkv         (forward + input grad + weight grad)
    block rows, per layer  3 * 2 * Q * (H*Hq + 2*H*Hkv + Hq*H + 3*H*I)
    attention, per layer   3 * 4 * P_l * D * heads       (QK^T and PV; backward = 2x forward)
    loss                   4 * N_loss * V * H            (logits + grad wrt hidden; lm_head frozen)
MFU = FLOPs / (step time * peak), peak = dense bf16 of the GPU (989 TFLOP/s for an H200).

Timing: each variant's rows are its steps run back to back as the trainer runs them (one sync a
round of --steps; the median over --repeats rounds, the spread of the rounds), and the same steps
each synchronised alone (', synced': the GPU starts every step idle and waits for the host's first
launches; the median over every step). The difference is the host's work that back-to-back steps
hide.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import Spread, wall_times  # noqa: E402
from dflash_common.drafter.attention import BlockLayout  # noqa: E402
from dflash_common.drafter.arch import as_arch, new_drafter  # noqa: E402
from dflash_common.drafter.config import DrafterConfig  # noqa: E402
from dflash_common.drafter.layer_ids import default_layer_ids  # noqa: E402
from dflash_common.drafter.loss import fused_lm_head_loss  # noqa: E402
from dflash_common.drafter.loss.selector import block_selector_loss  # noqa: E402
from dflash_common.drafter.objective import block_labels, sample_anchors  # noqa: E402
from train.loop import clip_and_step  # noqa: E402

H200_BF16_TFLOPS = 989.0  # dense, no sparsity


def qwen3_8b_drafter() -> DrafterConfig:
    return DrafterConfig(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        num_target_layers=36,
        target_layer_ids=tuple(default_layer_ids(36)),
        mask_token_id=151669,
        layer_types=("full_attention",) * 5,
        block_size=16,
        rope_theta=1e6,
    )


def tiny_drafter() -> DrafterConfig:
    return DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        num_target_layers=8,
        target_layer_ids=(1, 2, 3, 4, 5),
        mask_token_id=500,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=64,
        block_size=8,
        rope_theta=1e4,
    )


def make_batch(cfg: DrafterConfig, seqs: int, seq_len: int, anchors_per_seq: int, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    total = seqs * seq_len
    k_h = cfg.num_context_layers * cfg.hidden_size
    context = torch.randn(total, k_h, generator=g).to(device, torch.bfloat16)
    input_ids = torch.randint(0, cfg.vocab_size, (total,), generator=g).to(device)
    cu = torch.arange(0, total + 1, seq_len, device=device)
    loss_mask = torch.ones(total, dtype=torch.bool, device=device)
    anchors = sample_anchors(loss_mask.cpu(), cu.cpu(), cfg.block_size, anchors_per_seq, g).to(
        device
    )
    labels, weights = block_labels(input_ids, loss_mask, cu, anchors, cfg.block_size)
    return context, input_ids, cu, anchors, labels, weights


def step_flops(cfg: DrafterConfig, cu, anchors, total: int, n_loss: int) -> float:
    """The formula of the module docstring, with P_l counted exactly from the mask's row
    intervals."""
    h, d, i, k = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.num_context_layers
    hq, hkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    q = anchors.numel() * cfg.block_size
    layout = BlockLayout.build(cu, anchors, total, cfg.block_size)
    flops = 4.0 * total * k * h * h
    for layer in range(cfg.num_hidden_layers):
        ctx_lo, ctx_hi, blk_lo, blk_hi = layout.row_intervals(cfg.layer_sliding_window(layer))
        pairs = float((ctx_hi - ctx_lo).clamp(min=0).sum() + (blk_hi - blk_lo).clamp(min=0).sum())
        flops += 3 * 2 * total * h * 2 * hkv
        flops += 3 * 2 * q * (h * hq + 2 * h * hkv + hq * h + 3 * h * i)
        flops += 3 * 4 * pairs * d * cfg.num_attention_heads
    return flops + 4.0 * n_loss * cfg.vocab_size * h


def train_step(drafter, optimizer, batch, autocast_dtype):
    context, input_ids, cu, anchors, labels, weights = batch
    top_k = drafter.cfg.selector_top_k if drafter.cfg.arch == "dflash2" else 0
    autocast = torch.autocast(
        context.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
    )
    with autocast:
        hidden = drafter(context, input_ids, cu, anchors)  # [A, B, H]
    out = fused_lm_head_loss(
        hidden.flatten(0, 1),
        drafter.lm_head_weight,
        labels.flatten(),
        weights.flatten(),
        top_k=top_k,
    )
    loss = out.loss
    if top_k:  # DFlash2: the selector loss over the loss's top-k, under the same weights
        with autocast:
            sel = block_selector_loss(
                drafter, hidden, input_ids, anchors, labels, out.top_ids, out.top_values
            )
        loss = loss + (weights * sel.ce).sum()
    (loss / weights.sum()).backward()
    clip_and_step(optimizer, list(drafter.parameters()), 1.0)  # the trainer's clip and AdamW step
    optimizer.zero_grad(set_to_none=True)


def round_time(fn, steps: int, cuda: bool) -> float:
    """Seconds per call of `steps` calls run back to back, as the trainer runs its steps: one sync
    before and one after, so the host prepares a step while the GPU still runs the one before."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def build(cfg: DrafterConfig, device, cuda: bool, compiled: bool):
    torch.manual_seed(0)
    with torch.device(device):  # float32 master weights, initialised where they train
        drafter = new_drafter(cfg)
    v, h = cfg.vocab_size, cfg.hidden_size
    drafter.attach_frozen(
        torch.randn(v, h, device=device, dtype=torch.bfloat16),
        torch.randn(v, h, device=device, dtype=torch.bfloat16) * h**-0.5,
    )
    if compiled:
        drafter.compile_regions()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=6e-4, weight_decay=0.0, fused=cuda)
    return drafter, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny drafter on the CPU (smoke test)")
    parser.add_argument("--seqs", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds of --steps per variant, interleaved"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    parser.add_argument(
        "--variants",
        default="eager",
        help="comma list: eager (flex compiled, the rest eager), compiled (precision.compile), "
        "dflash2, dflash2-compiled",
    )
    parser.add_argument(
        "--profile", action="store_true", help="print each variant's kernels (torch.profiler)"
    )
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    cfg = qwen3_8b_drafter() if not args.quick else tiny_drafter()
    seq_len, anchors, steps = (
        (args.seq_len, args.anchors, args.steps) if not args.quick else (256, 16, 2)
    )
    repeats = args.repeats if not args.quick else 1
    batch = make_batch(cfg, args.seqs, seq_len, anchors, device)
    total, n_anchors = batch[0].shape[0], batch[3].numel()
    n_loss = int((batch[5] != 0).sum())
    variants = {}
    for name in args.variants.split(","):
        shape = as_arch(cfg, "dflash2") if name.startswith("dflash2") else cfg
        drafter, optimizer = build(shape, device, cuda, compiled=name.endswith("compiled") and cuda)

        def step(drafter=drafter, optimizer=optimizer):
            train_step(drafter, optimizer, batch, torch.bfloat16 if cuda else None)

        wall_times(step, 0, args.warmup if not args.quick else 1, cuda)  # warm-up (compilation)
        variants[name] = (step, drafter)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # per variant, two timings: rounds of back-to-back steps (the trainer's way: one figure a
    # round), and every step synchronised alone (one figure a step)
    times: dict[str, list[float]] = {}
    for _ in range(repeats):  # interleaved: a slow spell of the shared machine hits every variant
        for name, (step, _) in variants.items():
            times.setdefault(name, []).append(round_time(step, steps, cuda))
            times.setdefault(f"{name}, synced", []).extend(
                wall_times(step, steps, 0, cuda)
            )  # each step synced alone
    flops = step_flops(cfg, batch[2], batch[3], total, n_loss)
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    print(
        f"# drafter training step on {gpu}: {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"{args.seqs if not args.quick else 1} x {seq_len} tokens, {n_anchors} anchors x "
        f"{cfg.block_size}; {flops / 1e12:.2f} TFLOP per step; {repeats} interleaved repeats "
        f"of {steps} steps a variant: 'variant' rows run them back to back (the median of the "
        f"repeats' ms a step), ', synced' rows synchronise every step (the median of the steps)"
    )
    print(
        f"| {'variant':<18} | {'ms / step':>9} | {'spread ms':>13} | {'tokens / s':>10} | "
        f"{'TFLOP/s':>8} | {'MFU':>6} |"
    )
    print(f"|{'-' * 20}|{'-' * 11}|{'-' * 15}|{'-' * 12}|{'-' * 10}|{'-' * 8}|")
    for name in sorted(
        times, key=lambda n: (n.endswith("synced"), list(variants).index(n.split(",")[0]))
    ):
        ms = Spread.of(times[name]).scaled(1e3)
        sec = ms.median / 1e3
        mfu = f"{flops / sec / (args.peak_tflops * 1e12):.1%}" if cuda else "n/a"
        print(
            f"| {name:<18} | {ms.median:>9.1f} | {f'{ms.low:.1f}-{ms.high:.1f}':>13} | "
            f"{total / sec:>10,.0f} | {flops / sec / 1e12:>8.1f} | {mfu:>6} |"
        )
    params = sum(p.numel() for p in next(iter(variants.values()))[1].parameters())
    print(
        f"parameters {params / 1e6:.1f} M; peak memory "
        + (
            f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB (all variants resident)"
            if cuda
            else "n/a"
        )
    )
    if args.profile and cuda:
        from benchmarks.profiling import compare_timelines, kernel_table, profile_phase

        for name, (step, _) in variants.items():
            kernel_table(step, calls=3, title=f"drafter step, {name}")
        print("\n## drafter step: 3 steps of each variant, GPU busy and idle, the host's syncs")
        compare_timelines(
            [(name, profile_phase(step, calls=3)) for name, (step, _) in variants.items()]
        )


if __name__ == "__main__":
    main()
