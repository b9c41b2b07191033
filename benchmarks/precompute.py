"""Precompute throughput on a Qwen3-8B-shaped target: a plain HF forward against dflash-precompute.

    python benchmarks/precompute.py                    # GPU: Qwen3-8B shape, ~3K-token sequences (~2-3 min)
    python benchmarks/precompute.py --dir /nvme/tmp    # where the target and the stores go (local disk)
    python benchmarks/precompute.py --quick            # tiny target on the CPU: a smoke run in seconds
    python benchmarks/precompute.py --profile          # then each row once more under torch.profiler: where
                                                       # the time goes, (a) and (b) side by side

Printed step by step, with (a) and (b) interleaved --repeats times ((a), (b) bf16, (b) fp8, (a), ...):
1. the target: a Qwen3Config (hidden 4096, 36 layers, 32 heads, 8 kv heads, head_dim 128,
   intermediate 12288, vocab 151936) with random weights, created directly on the GPU in bf16 and
   saved (safetensors) under --dir with a byte-level tokenizer; no download;
2. --seqs pre-tokenized sequences of 2816-3072 tokens (a JSONL input, as users give);
3. the disk's raw write bandwidth (fsynced files, 1 stream and --writer-threads streams), so that a
   disk-bound row can be explained;
4. (a) what other tools do: the full HF model (AutoModelForCausalLM) with output_hidden_states=True
   over exactly the batches precompute forms, the 5 captured layers kept on the GPU, no I/O;
5. (b) dflash-precompute end to end, the CLI's code path (precompute.job.run) in this process, into
   a store under --dir, once with bf16 states and once with fp8_e4m3 (each store is deleted after
   its row: disk stays under ~35 GB at the default size).

Rows report the median over the repeats and the spread (lowest-highest tokens/s) of real tokens/s over
the timed phase ((a): the forward loop after one warm-up batch;
(b): first batch to last shard published, excluding target load and staging-buffer pinning, which
are printed apart), MFU, and (b)/(a). FLOPs = 2 x parameters run x tokens + attention, where
parameters run are the decoder layers ((a): all 36 and lm_head; (b): up to the deepest captured
layer) and attention is 2 x L^2 x heads x head_dim per layer per sequence of L tokens (the causal
half of QK^T and PV). MFU = FLOPs / (seconds x --peak-tflops), 989 for an H200 (dense bf16); "vs (a)" is
the median of the per-repeat ratios to the (a) run of the same repeat.
Goal: (b)/(a) >= 1.25 in bf16 and >= 1.35 in fp8: the early exit is worth ~1.12x, the rest must come
from a faster forward (`--compile on`: target.compile) with all I/O hidden.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_common.config import load_config  # noqa: E402
from dflash_common.drafter.layer_ids import default_layer_ids  # noqa: E402
from dflash_common.store import Store  # noqa: E402
from precompute.batching import pad_right  # noqa: E402
from precompute.config import PrecomputeConfig  # noqa: E402
from precompute.inputs import SkipLog  # noqa: E402
from precompute.pipeline import sort_window_batches  # noqa: E402
from precompute.tokenizing import TokenizedUnit  # noqa: E402

H200_BF16_TFLOPS = 989.0  # dense, no sparsity
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0,
            tie_word_embeddings=False)
_STARTED = time.perf_counter()


def say(text: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:6.1f} s] {text}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny target on the CPU, a few sequences: a smoke run")
    p.add_argument("--dir", default=None, help="local directory for the target and stores (default: a temp dir)")
    p.add_argument("--seqs", type=int, default=128,
                   help="sequences: 377K tokens at ~2944 each, 15.4 GB of bf16 states beside the 16.4 GB target")
    p.add_argument("--min-len", type=int, default=2816)
    p.add_argument("--max-len", type=int, default=3072)
    p.add_argument("--token-budget", type=int, default=16384,
                   help="padded tokens per forward (5 sequences: many batches, so the last write is short)")
    p.add_argument("--samples-per-unit", type=int, default=5, help="sequences per shard (0.6 GB in bf16)")
    p.add_argument("--writer-threads", type=int, default=8)
    p.add_argument("--queue-depth", type=int, default=4)
    p.add_argument("--disk-gb", type=float, default=4.0, help="bytes written by the raw disk test")
    p.add_argument("--dtypes", default="bf16,fp8_e4m3")
    p.add_argument("--compile", default="off,on",
                   help="(b) rows with target.compile off and/or on (its compilation is part of the target load)")
    p.add_argument("--copy-order", default="next",
                   help="(b) rows whose batches are copied to the host after the next forward is launched "
                        "('next', the pipeline's order) and/or as soon as encoded ('now', the order before)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS)
    p.add_argument("--keep", action="store_true", help="keep the target directory")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of (a) and each (b) row")
    p.add_argument("--profile", action="store_true",
                   help="after the timed repeats, one more (a) and (b) of each row under torch.profiler: where "
                        "the time goes, side by side (GPU busy and idle, copies, syncs, the GIL, kernel times)")
    args = p.parse_args(argv)
    for flag, value, allowed in (("--compile", args.compile, {"off", "on"}),
                                 ("--copy-order", args.copy_order, {"next", "now"})):
        if not value or not set(value.split(",")) <= allowed:
            p.error(f"{flag} {value!r}: give a comma-separated list of {' and '.join(sorted(allowed))}")
    args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    args.shape = dict(QWEN3_8B)
    if args.quick:
        args.shape = dict(TINY)
        args.seqs, args.min_len, args.max_len, args.token_budget, args.samples_per_unit = 12, 96, 160, 512, 2
        args.writer_threads, args.disk_gb, args.repeats = 2, 0.02, 2
        args.compile = "off"  # target.compile is ignored on a CPU
    return args


# ---------------------------------------------------------------------------------------- inputs


def build_target(path: Path, shape: dict, device: str) -> None:
    """Random weights from a Qwen3Config, made on `device` in bf16 (no fp32 copy, no CPU init)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_common.tiny import build_tiny_tokenizer

    config = Qwen3Config(**shape)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    params = sum(p.numel() for p in model.parameters())
    say(f"target built on {device}: {params / 1e6:,.1f} M parameters; saving to {path}")
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)  # the ids are pre-tokenized; a tokenizer must exist
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def synth_sequences(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(lo, hi + 1)), dtype=np.int32) for _ in range(n)]


def write_inputs(path: Path, seqs: list[np.ndarray]) -> None:
    with open(path, "w") as f:
        for s in seqs:
            prompt = len(s) // 10  # a response after a short prompt: the loss mask covers 90%
            f.write(json.dumps({"input_ids": s.tolist(), "loss_mask": [0] * prompt + [1] * (len(s) - prompt)}) + "\n")


def disk_bandwidth(directory: Path, total_bytes: int, streams: int) -> float:
    """GB/s of fsynced writes of `total_bytes` split over `streams` files written at once."""
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)  # 64 MiB, incompressible
    per = max(len(block), total_bytes // streams)

    def write(i: int) -> None:
        path = directory / f"disk-test-{i}"
        with open(path, "wb") as f:
            left = per
            while left > 0:
                left -= f.write(block[: min(left, len(block))])
            f.flush()
            os.fsync(f.fileno())

    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(write, range(streams)))
    seconds = time.perf_counter() - started
    for i in range(streams):
        (directory / f"disk-test-{i}").unlink()
    return per * streams / seconds / 1e9


def settle_disk() -> None:
    """Flush every dirty page (the saved target: 16 GB) before a timed phase: else the kernel writes
    it back during the phase, and the store's writes share the disk with it (a user's target was
    written long before precompute runs)."""
    started = time.perf_counter()
    os.sync()
    say(f"disk settled (sync) in {time.perf_counter() - started:.1f} s")


# ---------------------------------------------------------------------------------------- (a) and (b)


def batches_like_precompute(seqs: list[np.ndarray], samples_per_unit: int, budget: int) -> list[list[np.ndarray]]:
    """The batches precompute forms with sort_window_units = 1 (one window per unit)."""
    out = []
    for start in range(0, len(seqs), samples_per_unit):
        chunk = seqs[start: start + samples_per_unit]
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in chunk])])
        unit = TokenizedUnit(start // samples_per_unit, len(chunk), np.concatenate(chunk),
                             np.ones(offsets[-1], np.uint8), offsets, [str(i) for i in range(len(chunk))], SkipLog())
        out += [[chunk[n] for _, n in batch] for batch in sort_window_batches([unit], budget)]
    return out


def hf_forward(path: Path, batches: list[list[np.ndarray]], layer_ids: list[int], device: str,
               profiles: list | None = None) -> float:
    """(a): seconds of the full model's forward with output_hidden_states over `batches` (after a
    warm-up batch); the captured layers' states stay on the GPU, nothing is copied or written.
    With `profiles`, the loop runs under the profiler and its Timeline is appended."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 device_map={"": device}).eval()
    inputs = [pad_right(b, 0).to(device) for b in batches]
    with torch.inference_mode():
        model(input_ids=inputs[0], output_hidden_states=True, use_cache=False)  # warm-up, untimed
        _sync(device)
        say(f"(a) HF forward: {len(inputs)} batches{' (profiled)' if profiles is not None else ''}")

        def loop() -> None:
            for ids in inputs:
                out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
                kept = [out.hidden_states[i + 1] for i in layer_ids]  # noqa: F841  (what a tool would keep)
                del out
            _sync(device)

        started = time.perf_counter()
        if profiles is None:
            loop()
        else:
            from benchmarks.profiling import profile_phase

            profiles.append(profile_phase(loop))
        seconds = time.perf_counter() - started
    del model, inputs
    if device == "cuda":
        torch.cuda.empty_cache()
    return seconds


@contextlib.contextmanager
def profiled_forward_loop(profiles: list) -> Iterator[None]:
    """The job's forward loop (precompute.job.run_sort_windows, batches handed to the pipeline)
    under the profiler: what runs in it is the CLI's code; the writers' tail after it is not
    profiled."""
    import precompute.job as job

    from benchmarks.profiling import profile_phase

    plain = job.run_sort_windows
    job.run_sort_windows = lambda *a, **k: profiles.append(profile_phase(lambda: plain(*a, **k)))
    try:
        yield
    finally:
        job.run_sort_windows = plain


class Variant(NamedTuple):
    """One (b) row: the store's dtype, target.compile, and when a batch's copy to the host is queued."""

    dtype: str
    compiled: bool
    copy_next: bool = True

    @property
    def label(self) -> str:
        return (f"{self.dtype}{', compiled' if self.compiled else ''}"
                + ("" if self.copy_next else ", copy queued at once"))


def precompute_row(path: Path, inputs: Path, store: Path, variant: Variant, args) -> dict:
    """(b): run the precompute job into `store`; its summary holds the timings."""
    dtype, compiled = variant.dtype, variant.compiled
    overrides = [f"--target.path={path}", f"--data.inputs={json.dumps([str(inputs)])}", f"--store.path={store}",
                 f"--store.dtype={dtype}", f"--data.max_length={args.max_len}", "--data.block_size=16",
                 f"--batching.token_budget={args.token_budget}", "--batching.sort_window_units=1",
                 f"--run.samples_per_unit={args.samples_per_unit}", f"--run.writer_threads={args.writer_threads}",
                 f"--run.queue_depth={args.queue_depth}", f"--run.device={args.device}", "--target.dtype=bf16",
                 f"--target.compile={'true' if compiled else 'false'}"]
    from precompute.job import run
    from precompute.pipeline import Pipeline

    say(f"(b) dflash-precompute, {variant.label} -> {store}")
    Pipeline.copy_after_next_forward = variant.copy_next
    try:
        run(load_config(PrecomputeConfig, None, overrides))
    finally:
        Pipeline.copy_after_next_forward = True
    summary = Store.open(store).summary
    shutil.rmtree(store)
    shutil.rmtree(f"{store}.tokens", ignore_errors=True)
    return summary["runs"][-1]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------- report


def flops(shape: dict, layers: int, lm_head: bool, lengths: list[int]) -> float:
    """2 x parameters run x tokens + causal attention (2 x L^2 x heads x head_dim per layer)."""
    h, i, q = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    params = layers * per_layer + (shape["vocab_size"] * h if lm_head else 0)
    attention = layers * sum(2 * n * n * q for n in lengths)
    return 2 * params * sum(lengths) + attention


def report(rows: list[tuple], disk: list[tuple[str, float]], args) -> None:
    """rows: (name, tokens, [seconds per repeat], [MFU per repeat], [ratio to (a) per repeat])."""
    print(f"\nprecompute benchmark: {args.seqs} sequences of {args.min_len}-{args.max_len} tokens, token budget "
          f"{args.token_budget}, {args.samples_per_unit} sequences per shard, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f"; median of {args.repeats} interleaved repeats")
    print(f"{'row':<52} | {'tokens':>9} | {'seconds':>7} | {'tok/s':>9} | {'spread tok/s':>19} | {'MFU':>6} | "
          f"{'vs (a)':>6}")
    for name, tokens, seconds, mfu, ratio in rows:
        rates = sorted(tokens / x for x in seconds)
        mfu_text = f"{statistics.median(mfu):.1%}" if args.device == "cuda" else "—"
        spread = f"{rates[0]:,.0f}-{rates[-1]:,.0f}"
        print(f"{name:<52} | {tokens:>9,} | {statistics.median(seconds):>7.2f} | "
              f"{tokens / statistics.median(seconds):>9,.0f} | {spread:>19} | {mfu_text:>6} | "
              f"{statistics.median(ratio):>6.2f}")
    for name, gbps in disk:
        print(f"{name:<52} | {gbps:>7.2f} GB/s")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)  # a --dir not made yet is made
    root = Path(tempfile.mkdtemp(prefix="dflash-bench-", dir=args.dir))
    say(f"working in {root} (device {args.device})")
    try:
        run_all(args, root)
    finally:
        shutil.rmtree(root / "store-bf16", ignore_errors=True)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def run_all(args, root: Path) -> None:
    shape, target = args.shape, root / "target"
    build_target(target, shape, args.device)
    seqs = synth_sequences(args.seqs, args.min_len, args.max_len, shape["vocab_size"])
    lengths = [len(s) for s in seqs]
    write_inputs(root / "inputs.jsonl", seqs)
    say(f"{len(seqs)} sequences, {sum(lengths):,} tokens; measuring the disk")
    disk = [(f"disk write, fsynced, {n} stream(s)", disk_bandwidth(root, int(args.disk_gb * 1e9), n))
            for n in sorted({1, args.writer_threads})]
    layer_ids = default_layer_ids(shape["num_hidden_layers"])
    peak = args.peak_tflops * 1e12
    full = flops(shape, shape["num_hidden_layers"], True, lengths)
    early = flops(shape, max(layer_ids) + 1, False, lengths)
    batches = batches_like_precompute(seqs, args.samples_per_unit, args.token_budget)
    variants = [Variant(d, c == "on", o == "next") for d in args.dtypes.split(",") for c in args.compile.split(",")
                for o in args.copy_order.split(",")]
    a_seconds: list[float] = []
    b_runs: dict[Variant, list[dict]] = {v: [] for v in variants}
    for rep in range(args.repeats):  # interleaved: a slow spell of the shared machine hits every row
        say(f"repeat {rep + 1} of {args.repeats}")
        settle_disk()
        a_seconds.append(hf_forward(target, batches, layer_ids, args.device))
        for variant in variants:
            settle_disk()
            run = precompute_row(target, root / "inputs.jsonl", root / f"store-{variant.dtype}", variant, args)
            s = run["seconds"]
            say(f"(b) {variant.label}: target load {s['load_target']:.1f} s, staging buffers {s['staging_setup']:.1f} s, "
                f"{run['bytes_written'] / 1e9:.2f} GB written, the forward waited {run['disk_wait_s_max_rank']:.2f} s "
                f"for the disk, the GPU stood idle {run.get('gpu_idle_s_max_rank', 0.0):.2f} s between batches "
                f"(computed {run.get('gpu_busy_s', 0.0):.2f} s of {s['forward_write']:.2f}), "
                f"{run['max_units_in_memory']} units in host memory at most")
            b_runs[variant].append(run)
    tokens = sum(lengths)
    rows = [("(a) HF forward, output_hidden_states, states on GPU", tokens, a_seconds,
             [full / x / peak for x in a_seconds], [1.0] * len(a_seconds))]
    for variant, runs in b_runs.items():
        secs = [r["seconds"]["forward_write"] for r in runs]
        forwarded = runs[0]["tokens_forwarded"]
        name = f"(b) dflash-precompute -> store, {variant.label}"
        rows.append((name, forwarded, secs, [early / x / peak for x in secs],
                     [(forwarded / x) / (tokens / a) for x, a in zip(secs, a_seconds)]))
        disk.append((f"store write during (b), {variant.label} (median)", statistics.median(
            r["bytes_written"] / 1e9 / r["seconds"]["forward_write"] for r in runs)))
    report(rows, disk, args)
    if args.profile:
        profile_rows(target, batches, layer_ids, variants, root, args)


def profile_rows(target: Path, batches, layer_ids: list[int], variants, root: Path, args) -> None:
    """One more (a) and (b) of each row, each under the profiler, then their Timelines side by side."""
    from benchmarks.profiling import compare_timelines

    named: list[tuple[str, object]] = []
    settle_disk()
    profiles: list = []
    hf_forward(target, batches, layer_ids, args.device, profiles)
    named.append(("(a)", profiles[-1]))
    for variant in variants:
        settle_disk()
        with profiled_forward_loop(profiles):
            precompute_row(target, root / "inputs.jsonl", root / f"store-{variant.dtype}", variant, args)
        named.append((f"(b) {variant.label}", profiles[-1]))
    print("\nprofile: one more run of each row under torch.profiler ((b): its forward loop, without the last "
          "shard's write after it)")
    compare_timelines(named)


if __name__ == "__main__":
    main()
