"""LM-head loss, forward + backward: our fused loss vs plain PyTorch vs Liger-Kernel.

    PYTHONPATH=. python benchmarks/loss.py            # on a GPU: the two sizes of the goal, bf16
    PYTHONPATH=. python benchmarks/loss.py --quick    # CPU smoke run at tiny sizes

Time is the median over repetitions (CUDA events on a GPU), the rows' repetitions interleaved in a
new random order each round; peak memory is the largest allocation above what the inputs (hidden,
lm_head, labels, weights) already hold, over one forward + backward after two warm-ups.
Rows: our loss with every row weighted, our loss with DFlash block weights (position 0 of every
16-token block has weight 0 and is skipped), each by its methods (exact; label odds, one pass over
the logits; label odds in the logits matmul's epilogue: loss/hard.py), plain PyTorch (logits +
F.cross_entropy) and, when importable, Liger-Kernel's LigerFusedLinearCrossEntropyLoss (which
applies no per-token weights).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import Spread, cuda_ms  # noqa: E402
from dflash_common.drafter.loss.hard import ODDS_LOG_LIMIT, fused_lm_head_loss, new_odds_results  # noqa: E402
from dflash_common.drafter.objective import default_gamma  # noqa: E402

GOAL_SIZES = [(16384, 4096, 151936), (65536, 5120, 248320)]  # (N, H, V)
QUICK_SIZES = [(256, 64, 1000), (512, 96, 2003)]
BLOCK = 16  # DFlash block size: 1 row in 16 carries weight 0


def make_inputs(n, h, v, device, dtype, block_weights: bool):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=g).requires_grad_(True)
    weight = (torch.randn(v, h, device=device, dtype=dtype, generator=g) * h**-0.5).requires_grad_(
        False
    )
    labels = torch.randint(0, v, (n,), device=device, generator=g)
    weights = _block_weights(n, device) if block_weights else torch.ones(n, device=device)
    return hidden, weight, labels, weights


def _block_weights(n, device) -> torch.Tensor:
    """DFlash's position weights: 0 at position 0 of each block, then exp(-(k - 1) / gamma)."""
    k = torch.arange(n, device=device) % BLOCK
    return torch.where(k == 0, 0.0, torch.exp(-(k - 1).clamp(min=0) / default_gamma(BLOCK)))


def ours(backend, method="exact"):
    def run(hidden, weight, labels, weights):
        return fused_lm_head_loss(
            hidden, weight, labels, weights, backend=backend, method=method
        ).loss

    return run


def plain_torch(hidden, weight, labels, weights):
    logits = hidden @ weight.T  # [N, V] materialised
    return (F.cross_entropy(logits.float(), labels, reduction="none") * weights).sum()


def liger():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    module = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def run(hidden, weight, labels, weights):
        return module(weight, hidden, labels)  # no per-token weights

    return run


def time_call(fn, inputs) -> tuple[float, int | None]:
    """(ms, peak bytes above what was allocated before, None on the CPU) of one
    fn(*inputs).backward()."""
    hidden = inputs[0]
    hidden.grad = None
    if not hidden.is_cuda:
        t0 = time.perf_counter()
        fn(*inputs).backward()
        hidden.grad = None
        return (time.perf_counter() - t0) * 1e3, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*inputs).backward()
    end.record()
    torch.cuda.synchronize()
    hidden.grad = None
    return start.elapsed_time(end), torch.cuda.max_memory_allocated() - base


def measure(fn, inputs, reps: int) -> tuple[float, float | None, tuple[float, float]]:
    """(median ms, peak GiB above the inputs, (lowest, highest) ms) of fn(*inputs).backward(), after
    two warm-up calls (compilation; one-time allocations such as cuBLAS's workspace are no call's
    peak)."""
    for _ in range(2):
        time_call(fn, inputs)
    calls = [time_call(fn, inputs) for _ in range(reps)]
    times = [ms for ms, _ in calls]
    peak = None if calls[0][1] is None else max(p for _, p in calls) / 2**30
    return statistics.median(times), peak, (min(times), max(times))


# (backend, method, label): the exact method keeps the labels of the earlier tables
WAYS = [
    ("triton", "exact", "triton"),
    ("triton", "odds", "triton, odds"),
    ("triton", "odds_epilogue", "triton, odds epilogue"),
    ("torch", "exact", "torch"),
]


def ways_on(device) -> list[tuple[str, str, str]]:
    """The WAYS this device runs: Triton's on CUDA or under TRITON_INTERPRET=1, torch's
    everywhere."""
    triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return [w for w in WAYS if triton or w[0] == "torch"]


def rows_for(device) -> list[tuple[str, object, bool]]:
    """(label, fn or None when not importable, block weights?) per row."""
    ways = ways_on(device)
    rows = [
        (f"dflash fused [{label}], all rows weighted", ours(b, m), False) for b, m, label in ways
    ]
    rows += [
        (f"dflash fused [{label}], block weights (1/16 skipped)", ours(b, m), True)
        for b, m, label in ways
    ]
    rows.append(("plain PyTorch (logits + F.cross_entropy)", plain_torch, False))
    rows.append(("Liger fused linear CE (no token weights)", liger(), False))
    return rows


def table(sizes, device, dtype, reps: int) -> None:
    """Every row of one size on the same inputs, interleaved: two warm-up calls of each row, then
    rep 1 of every row, rep 2 of every row, ..., each rep in a new (seeded) random order. A GPU at
    its power limit runs a call faster after a lighter one, so no row may always follow the same."""
    print(f"| {'loss':<68} | {'N, H, V':<20} | {'ms':>9} | {'spread ms':>15} | {'peak GiB':>9} |")
    print(f"|{'-' * 70}|{'-' * 22}|{'-' * 11}|{'-' * 17}|{'-' * 11}|")
    for n, h, v in sizes:
        size = f"{n}, {h}, {v}"
        hidden, weight, labels, unit = make_inputs(n, h, v, device, dtype, False)
        block = _block_weights(n, device)
        rows = rows_for(device)
        calls: dict[str, list[tuple[float, int | None]]] = {}
        for label, fn, block_weights in rows:
            if fn is None:
                continue
            inputs = (hidden, weight, labels, block if block_weights else unit)
            try:
                for _ in range(2):
                    time_call(fn, inputs)
                calls[label] = []
            except torch.OutOfMemoryError:
                hidden.grad = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        order = random.Random(0)
        for _ in range(reps):
            for label, fn, block_weights in order.sample(rows, len(rows)):
                if label in calls:
                    calls[label].append(
                        time_call(fn, (hidden, weight, labels, block if block_weights else unit))
                    )
        for label, fn, _ in rows:
            if fn is None:
                print(f"| {label:<68} | {size:<20} | {'skipped: liger-kernel not installed':<39} |")
            elif label not in calls:
                print(f"| {label:<68} | {size:<20} | {'OOM':>9} | {'':>15} | {'OOM':>9} |")
            else:
                times = [ms for ms, _ in calls[label]]
                peaks = [p for _, p in calls[label]]
                peak_text = "n/a" if peaks[0] is None else f"{max(peaks) / 2**30:.2f}"
                print(
                    f"| {label:<68} | {size:<20} | {statistics.median(times):>9.1f} "
                    f"| {f'{min(times):.1f}-{max(times):.1f}':>15} | {peak_text:>9} |",
                    flush=True,
                )
        del hidden, weight, labels, unit, block, calls
        if device.type == "cuda":
            torch.cuda.empty_cache()


def sweep(sizes, device, dtype, reps: int) -> None:
    """Chunk height vs time and memory: how the default chunk budget was chosen."""
    print(f"| {'chunk rows':>10} | {'N, H, V':<20} | {'ms':>9} | {'peak GiB':>9} |")
    for n, h, v in sizes:
        inputs = make_inputs(n, h, v, device, dtype, False)
        for rows in (256, 384, 512, 640, 768, 1024, 1280, 1536, 2048):

            def fn(hidden, weight, labels, weights, rows=rows):
                chunk_bytes = rows * v * weight.element_size()
                return fused_lm_head_loss(
                    hidden, weight, labels, weights, chunk_bytes=chunk_bytes
                ).loss

            ms, peak, _ = measure(fn, inputs, reps)
            print(f"| {rows:>10} | {f'{n}, {h}, {v}':<20} | {ms:>9.1f} | {peak or 0:>9.2f} |")
        del inputs


# (columns per step, warps) of the row kernel; its default is hard_triton.MAX_BLOCK / NUM_WARPS
SWEEP_SHAPES = [(4096, 16), (8192, 16), (8192, 32), (16384, 32), (4096, 32), (16384, 16)]


def kernel_sweep(
    device, dtype, rows: int = 512, vocab: int = 151936, hidden_size: int = 4096, reps: int = 20
) -> None:
    """The row kernel alone on one logits chunk [rows, vocab] (forward + gradient in place) per
    launch shape: ms and GB/s counting its three passes over the chunk (read, read, write). Before
    each call the chunk is made by the logits matmul into the same buffer, as in the loss, so the
    kernel finds in L2 what it would find there; the matmul is outside the timing. Each shape's
    result is checked against the first's. Liger-Kernel's row kernel, launched as its fused linear
    cross-entropy does, is a row when importable."""
    from dflash_common.drafter.loss.hard_triton import MAX_BLOCK, NUM_WARPS, weighted_ce_rows

    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, hidden_size, device=device, dtype=dtype, generator=g) * 4
    w = torch.randn(vocab, hidden_size, device=device, dtype=dtype, generator=g) * hidden_size**-0.5
    logits = torch.empty(rows, vocab, device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (rows,), device=device, generator=g)
    weights = torch.ones(rows, device=device)
    moved = 3 * logits.numel() * logits.element_size()

    def timed(run) -> tuple[list[float], object]:
        times = []
        for i in range(reps + 3):
            torch.mm(h, w.T, out=logits)
            ms, out = cuda_ms(run)
            if i >= 3:
                times.append(ms)
        return times, out

    def line(label: str, times: list[float], note: str = "") -> None:
        ms = statistics.median(times)
        print(
            f"| {label:<52} | {ms:>7.3f} | {f'{min(times):.3f}-{max(times):.3f}':>13} "
            f"| {moved / ms / 1e6:>7.0f} |" + note,
            flush=True,
        )

    print(f"| {'row kernel':<52} | {'ms':>7} | {'spread ms':>13} | {'GB/s':>7} |")
    reference = None
    for block, warps in SWEEP_SHAPES:
        times, out = timed(
            lambda b=block, w=warps: weighted_ce_rows(
                logits, labels, weights, True, block=b, num_warps=w
            )
        )
        if reference is None:
            reference = (out[0].clone(), out[1].clone(), logits.clone())
        ok = (
            torch.allclose(out[0], reference[0], rtol=1e-5, atol=1e-4)
            and torch.equal(out[1], reference[1])
            and torch.allclose(logits.float(), reference[2].float(), rtol=2e-2, atol=1e-6)
        )
        default = " (default)" if (block, warps) == (MAX_BLOCK, NUM_WARPS) else ""
        line(
            f"ours: {block} columns/step, {warps} warps{default}", times, "" if ok else " MISMATCH"
        )
    liger_rows = _liger_row_kernel(logits, labels)
    if liger_rows is not None:
        line(f"Liger: {liger_rows[0]}", timed(liger_rows[1])[0])
    odds_rows(logits, labels, weights, timed, line)
    epilogue_matmul(h, w, labels, weights, reps)


def odds_rows(logits, labels, weights, timed, line) -> None:
    """The label-odds row kernel on the same chunk: one read and one write (GB/s still counted over
    the three passes above, so that the columns compare as times); its CE checked against the exact
    kernel's."""
    from dflash_common.drafter.loss.hard_triton import label_odds_rows, weighted_ce_rows

    out = new_odds_results(logits.shape[0], logits.device)
    times, _ = timed(lambda: label_odds_rows(logits, labels, weights, True, out, ODDS_LOG_LIMIT))
    _, (exact, _) = timed(lambda: weighted_ce_rows(logits, labels, weights, False))
    ok = torch.allclose(out[0], exact, rtol=1e-4, atol=1e-4) and bool(out[4].all())
    line("ours, label odds: one pass (read, write)", times, "" if ok else " MISMATCH")


def epilogue_matmul(h, w, labels, weights, reps: int) -> None:
    """The logits matmul of one chunk: cuBLAS (h @ W^T into a preallocated buffer, as the loss runs
    it) beside the Triton matmul that forms the odds in its epilogue (with its label dot and per-row
    fold; autotuned on the first call), in TFLOP/s of the matmul's 2 C V H."""
    from dflash_common.drafter.loss.epilogue_triton import _odds_matmul_tuned, odds_matmul

    c, v = h.shape[0], w.shape[0]
    logits = torch.empty(c, v, device=h.device, dtype=h.dtype)
    out = new_odds_results(c, h.device)
    flops = 2 * c * v * h.shape[1]
    print(
        f"\n| {'logits matmul of one chunk':<52} | {'ms':>7} | {'spread ms':>13} | {'TFLOP/s':>7} |"
    )
    for label, run in (
        ("cuBLAS, h @ W^T", lambda: torch.mm(h, w.T, out=logits)),
        (
            "Triton, odds in the epilogue (+ label dot, fold)",
            lambda: odds_matmul(h, w, labels, weights, True, out, ODDS_LOG_LIMIT),
        ),
    ):
        run()  # the first call tunes the Triton tiles
        ms = Spread.of([cuda_ms(run)[0] for _ in range(reps)])
        print(
            f"| {label:<52} | {ms.median:>7.3f} | {f'{ms.low:.3f}-{ms.high:.3f}':>13} "
            f"| {flops / ms.median / 1e9:>7.0f} |",
            flush=True,
        )
    print(f"Triton tiles chosen: {_odds_matmul_tuned.best_config}")
    for config, ms in (
        getattr(_odds_matmul_tuned, "configs_timings", None) or {}
    ).items():  # the tuner's own timings
        ms = ms[0] if isinstance(ms, (list, tuple)) else ms
        print(f"  tried {config}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")


def _liger_row_kernel(logits, labels):
    """(description, call) of Liger-Kernel's cross-entropy row kernel as its fused linear
    cross-entropy launches it on a chunk (gradient in place, sum reduction, no accuracy), or None
    when not installed."""
    try:
        import triton
        from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel
    except ImportError:
        return None
    rows, vocab = logits.shape
    block = min(32768, triton.next_power_of_2(vocab))
    loss = torch.zeros(rows, dtype=torch.float32, device=logits.device)

    def call():
        liger_cross_entropy_kernel[(rows,)](
            X_ptr=logits,
            X_stride=logits.stride(-2),
            Y_ptr=labels,
            Y_stride=labels.stride(-1),
            weight_ptr=None,
            loss_ptr=loss,
            z_loss_ptr=None,
            loss_stride=loss.stride(-1),
            token_accuracy_ptr=None,
            token_accuracy_stride=0,
            predicted_tokens_ptr=None,
            predicted_tokens_stride=0,
            n_cols=vocab,
            n_non_ignore=rows,
            sum_non_ignore_weight=rows,
            weight_sum=0.0,
            ignore_index=-100,
            lse_square_scale=0.0,
            label_smoothing=0.0,
            reduction="sum",
            softcap=None,
            RETURN_Z_LOSS=False,
            RETURN_TOKEN_ACCURACY=False,
            RETURN_PREDICTED_TOKENS=False,
            HAS_WEIGHT=False,
            HAS_SOFTCAPPING=False,
            HAS_GRADIENTS=True,
            BLOCK_SIZE=block,
            num_warps=32,
        )
        return loss

    return f"{block} columns/step, 32 warps", call


def profile(size, device, dtype) -> None:
    from benchmarks.profiling import kernel_table

    n, h, v = size
    for label, fn, block_weights in rows_for(device):
        if fn is None or label.startswith("plain"):
            continue
        inputs = make_inputs(n, h, v, device, dtype, block_weights)
        measure(fn, inputs, 1)  # warm-up

        def once(fn=fn, inputs=inputs):
            inputs[0].grad = None
            fn(*inputs).backward()

        kernel_table(once, calls=3, title=f"{label}, N={n}")
        del inputs


def precision(device, reps: int = 3) -> None:
    """Gradient and CE error of each method against float64 on the same bf16-rounded inputs, for
    rows of every confidence ('typical': random hidden, CE ~3-50 nats) and confident rows (hidden
    along the label's lm_head row, CE from ~0.1 down to ~1e-30): per row |grad - ref| / |ref|,
    median and largest over rows, each the median over `reps` seeds."""
    n, h, v = (64, 64, 2000)
    ways = ways_on(device)
    print(
        f"| {'rows':<10} | {'method':<24} | {'grad rel. err, median':>21} | {'largest':>8} "
        f"| {'CE abs. err, largest':>20} |"
    )
    print(f"|{'-' * 12}|{'-' * 26}|{'-' * 23}|{'-' * 10}|{'-' * 22}|")
    for case in ("typical", "confident"):
        errors: dict[str, list[tuple[float, float, float]]] = {}
        for seed in range(reps):
            g = torch.Generator().manual_seed(seed)
            weight = (torch.randn(v, h, generator=g) * 0.3).to(device, torch.bfloat16)
            labels = torch.randint(0, v, (n,), generator=g).to(device)
            scale = torch.linspace(2, 12, n) if case == "confident" else torch.linspace(0.5, 4, n)
            base = (
                weight[labels].float().cpu()
                if case == "confident"
                else torch.randn(n, h, generator=g)
            )
            hidden = (base * scale[:, None]).to(device, torch.bfloat16)
            ref = hidden.double().requires_grad_(True)
            ce = F.cross_entropy(ref @ weight.double().T, labels, reduction="none")
            ce.sum().backward()
            for backend, method, label in ways:
                x = hidden.clone().requires_grad_(True)
                unit = torch.ones(n, device=device)
                out = fused_lm_head_loss(x, weight, labels, unit, backend=backend, method=method)
                out.loss.backward()
                rel = (x.grad.double() - ref.grad).norm(dim=1) / ref.grad.norm(dim=1)
                ce_err = (out.rows.double() - ce.detach()).abs().max().item()
                errors.setdefault(label, []).append((rel.median().item(), rel.max().item(), ce_err))
        for label, runs in errors.items():
            med, most, ce_err = (statistics.median(r[i] for r in runs) for i in range(3))
            print(
                f"| {case:<10} | {label:<24} | {med:>21.2e} | {most:>8.2e} | {ce_err:>20.2e} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (smoke test)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--profile", action="store_true", help="print the kernels of our loss and Liger's (CUDA)"
    )
    parser.add_argument(
        "--kernel-sweep",
        action="store_true",
        help="time the row kernel alone per (columns per step, warps) on one chunk, "
        "beside Liger's (CUDA)",
    )
    parser.add_argument(
        "--sizes", default="all", choices=["all", "first"], help="'first': only N=16384"
    )
    parser.add_argument(
        "--precision",
        action="store_true",
        help="each method's gradient and CE error against float64 (any device; on the CPU the "
        "Triton rows need TRITON_INTERPRET=1)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="time our Triton loss at several fixed chunk heights (rows) instead of the table",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = QUICK_SIZES if args.quick else GOAL_SIZES[:1] if args.sizes == "first" else GOAL_SIZES
    reps = 3 if args.quick else args.reps
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    if args.precision:
        print(
            f"# LM-head loss on {name}: gradient and CE error against float64, bf16 inputs, "
            f"64 rows, H=64, V=2000, median over 3 seeds"
        )
        return precision(device)
    print(
        f"# LM-head loss forward+backward on {name}, {str(dtype).removeprefix('torch.')}, "
        f"median of {reps}" + ", repeats interleaved across the rows"
    )
    if args.sweep:
        return sweep(sizes, device, dtype, reps)
    if args.profile and device.type == "cuda":
        return profile(sizes[0], device, dtype)
    if args.kernel_sweep and device.type == "cuda":
        return kernel_sweep(device, dtype)
    table(sizes, device, dtype, reps)


if __name__ == "__main__":
    main()
