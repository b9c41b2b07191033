"""Generation throughput: dflash-generate's transformers decoder against plain `model.generate`.

    python benchmarks/generate.py                  # GPU: Qwen3-8B and Qwen3-0.6B shapes, bf16 (~5 min)
    python benchmarks/generate.py --quick          # a tiny target on the CPU: a smoke run in seconds

For each shape, a Qwen3Config target with random weights is built directly on the device (no download)
and decodes the same batch of random prompts (--batch x --prompt-len tokens, left-padded to random
lengths in [prompt-len/2, prompt-len]) for exactly --new-tokens tokens (no stop token):

    (a) plain HF: model.generate(do_sample=False), default dynamic KV cache, the whole batch at once
    (b) dflash-generate with eager decode steps: TransformersDecoder(cuda_graphs=False).decode_batch
        (static KV cache, the host launches every kernel of every step)
    (c) dflash-generate with generate.cuda_graphs: each decode step a CUDA graph, captured once per batch
        (CUDA only)
    (d) (c) with generate.compile too: the decoder layers' parts compiled (on a second copy of the target,
        which compiling changes in place), the compiled step captured as the graph (CUDA only)

All decode the same batch (the same batch budget). Rows report generated tokens/s (batch x new tokens /
seconds): the median of --repeats runs, interleaved a, b, c, d, a, b, c, d, ... after one warm-up of each,
with the lowest and highest beside it; (c)/(a), and the memory-bandwidth roofline of decoding: each step
reads every weight once and the KV cache of the batch, so a step takes at least
(weight bytes + KV bytes at the mean context) / --bandwidth (4.8 TB/s for an H200), and the
roofline is batch / that time. Goal: the best of (b)-(d) >= 3x (a). --modes picks the columns to run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == ROOT / "benchmarks":
    sys.path[0] = str(ROOT)  # benchmarks/precompute.py would shadow the precompute package

SHAPES = {  # Qwen3 configs (hidden, layers, heads, kv heads, head_dim, intermediate, vocab)
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=320),
}


def build(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=8192, pad_token_id=0, eos_token_id=1)
    with torch.device(device):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(dtype).eval()
    return model


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, length // 2), length + 1, (batch,), generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def timed(fn, device: torch.device) -> float:
    """Seconds of one call of fn (the caller warms it up first)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


@torch.no_grad()
def plain_generate(model, batch: list[list[int]], new_tokens: int, device: torch.device) -> None:
    width = max(map(len, batch))
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)


def roofline(model, batch: list[list[int]], new_tokens: int, bandwidth: float) -> float:
    """Tokens/s if every decode step only had to read the weights and the batch's KV cache."""
    c = model.config
    elem = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elem
    context = sum(len(p) for p in batch) / len(batch) + new_tokens / 2
    kv = len(batch) * context * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * elem
    return len(batch) / ((weights + kv) / bandwidth)


def bench(shape: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    from dflash_common.sampling import Sampling
    from precompute.generate.decode import Request, TransformersDecoder

    model = build(shape, device, dtype)
    batch = prompts(args.batch, args.prompt_len, model.config.vocab_size)
    sampling = Sampling(0.0, 1.0, 0, args.new_tokens, 0)
    requests, tokens = [Request(p, 0) for p in batch], args.batch * args.new_tokens
    row = {"shape": shape, "roofline": roofline(model, batch, args.new_tokens, args.bandwidth)}
    runs = {}
    if "a" in args.modes:
        runs["a"] = lambda: plain_generate(model, batch, args.new_tokens, device)
    for mode, graphs in (("b", False), ("c", True)):
        decoder = TransformersDecoder(model, {-1}, 0, sampling, token_budget=10**9, max_batch=10**6,
                                      cuda_graphs=graphs)
        if mode in args.modes and decoder.cuda_graphs == graphs:  # (c) needs CUDA
            runs[mode] = lambda d=decoder: d.decode_batch(requests)
    if "d" in args.modes and device.type == "cuda":  # a second copy of the target: compiling changes it in place
        compiled = TransformersDecoder(build(shape, device, dtype), {-1}, 0, sampling, token_budget=10**9,
                                       max_batch=10**6, compile=True, cuda_graphs=True)
        runs["d"] = lambda d=compiled: d.decode_batch(requests)
    for fn in runs.values():
        fn()  # warm-up (allocations, kernels, compilation)
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved: a slow spell of the shared machine hits every column
        for k, fn in runs.items():
            seconds[k].append(timed(fn, device))
    for k, xs in seconds.items():
        row[k] = tokens / statistics.median(xs)
        row[k + "_spread"] = (tokens / max(xs), tokens / min(xs))
    if args.profile and device.type == "cuda":
        from benchmarks.profiling import kernel_table

        short = Sampling(0.0, 1.0, 0, 32, 0)  # 32 new tokens: the steps, with the prefill beside them
        for mode, graphs in (("b", False), ("c", True)):
            if mode in runs:
                d = TransformersDecoder(model, {-1}, 0, short, token_budget=10**9, max_batch=10**6,
                                        cuda_graphs=graphs)
                d.decode_batch(requests)
                kernel_table(lambda d=d: d.decode_batch(requests), calls=1, title=f"{shape} ({mode}), 32 new tokens")
        if "d" in runs:  # its decoder decodes --new-tokens: the whole run
            kernel_table(runs["d"], calls=1, title=f"{shape} (d), {args.new_tokens} new tokens")
        kernel_table(lambda: plain_generate(model, batch, 32, device), calls=1, title=f"{shape} (a), 32 new tokens")
    model = decoder = compiled = None  # free the weights before the next shape is built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny target on the CPU, a few tokens")
    parser.add_argument("--shapes", default="qwen3-8b,qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--modes", default="abcd",
                        help="columns to run: a plain generate, b eager steps, c graphs, d compiled + graphs")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each column, interleaved")
    parser.add_argument("--profile", action="store_true", help="print the kernels of 32-token decodes (CUDA)")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s of device memory (H200: 4.8e12)")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.batch, args.prompt_len, args.new_tokens, args.repeats = "tiny", 4, 16, 8, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device {device}, {dtype}, batch {args.batch} x prompts of {args.prompt_len // 2}-{args.prompt_len} "
          f"tokens, {args.new_tokens} new tokens each; roofline at {args.bandwidth / 1e12:.1f} TB/s; tok/s is the "
          f"median of {args.repeats} interleaved runs after one warm-up, [lowest-highest] beside it")
    print(f"{'target':<12} | {'(a) model.generate tok/s':>26} | {'(b) eager steps tok/s':>26} | "
          f"{'(c) CUDA graphs tok/s':>26} | {'(d) compiled + graphs':>26} | {'(b)/(a)':>7} | {'(c)/(a)':>7} | "
          f"{'(d)/(a)':>7} | {'roofline tok/s':>14} | {'best/roofline':>13}")
    for shape in args.shapes.split(","):
        r = bench(shape, args, device, dtype)

        def cell(k: str) -> str:
            if k not in r:
                return f"{'n/a':>26}"
            lo, hi = r[k + "_spread"]
            return f"{f'{r[k]:,.0f} [{lo:,.0f}-{hi:,.0f}]':>26}"

        ratio = lambda k: f"{r[k] / r['a']:>7.2f}" if k in r and "a" in r else f"{'n/a':>7}"  # noqa: E731
        best = max((r[k] for k in ("b", "c", "d") if k in r), default=None)
        print(f"{r['shape']:<12} | {cell('a')} | {cell('b')} | {cell('c')} | {cell('d')} | {ratio('b')} | "
              f"{ratio('c')} | {ratio('d')} | "
              f"{r['roofline']:>14,.0f} | " + (f"{best / r['roofline']:>13.1%}" if best else f"{'n/a':>13}"))


if __name__ == "__main__":
    main()
