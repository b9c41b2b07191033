"""How to batch the target forward: padding cost of length-sorted token-budget batches, and the
correctness and speed of right padding (with / without an attention mask) against packing.

    python benchmarks/precompute_batching.py --quick        # tiny target, CPU, seconds
    python benchmarks/precompute_batching.py --device cuda  # same table on a GPU
    python benchmarks/precompute_batching.py --device cuda --qwen3-8b-layers 8
        # + the real layer shape

Prints three tables: padding fraction by sort window; per-layout forward time (median and spread of
the repeats) plus the largest difference of a sequence's states from its states computed alone
(0 = no leak); and the same leak check on a hybrid linear-attention target.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import Spread, wall_times  # noqa: E402
from dflash_common.tiny import TinySpec, build_tiny_target  # noqa: E402
from precompute.batching import pad_right, padding_fraction, plan_batches  # noqa: E402


def lengths_like_chat(n: int, max_length: int, seed: int = 0) -> list[int]:
    """Log-normal lengths (median ~1200 tokens), clipped to [64, max_length], like chat data."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(1200), 0.7, n), 64, max_length).astype(int).tolist()


def padding_table(n: int, budget: int, max_length: int) -> None:
    lengths = lengths_like_chat(n, max_length)
    print(f"\npadding fraction, {n} samples, token budget {budget}")
    print(f"{'sort window (samples)':>22} | {'padding':>8} | {'batches':>7}")
    for window in (1, 32, 128, 512, n):
        batches = []
        for start in range(0, n, window):
            chunk = lengths[start : start + window]
            batches += [[start + i for i in b] for b in plan_batches(chunk, budget)]
        print(f"{window:>22} | {padding_fraction(lengths, batches):>8.1%} | {len(batches):>7}")


def tiny_model(path: Path, device: str) -> torch.nn.Module:
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoModel.from_pretrained(path, dtype=torch.float32).to(device).eval()


def qwen3_8b_layers(device: str, layers: int) -> torch.nn.Module:
    """Qwen3-8B's layer shape (hidden 4096, 32 heads, 8 kv heads, head_dim 128, MLP 12288) with
    random bf16 weights made on `device`, `layers` deep: the layouts' relative cost is per layer."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return Qwen3Model(config).eval()
    finally:
        torch.set_default_dtype(default)


def forward_table(
    model: torch.nn.Module, label: str, device: str, n: int, max_length: int, repeats: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = sorted(lengths_like_chat(n, max_length, seed=1), reverse=True)
    seqs = [torch.randint(0, 256, (m,), generator=gen).numpy() for m in lengths]

    def run(**kw):
        return model(**{k: v.to(device) for k, v in kw.items()}, use_cache=False).last_hidden_state

    with torch.inference_mode():
        alone = [run(input_ids=torch.from_numpy(s).long()[None])[0] for s in seqs]
        padded = pad_right(seqs, 0)
        mask = (torch.arange(padded.shape[1])[None] < torch.tensor(lengths)[:, None]).long()
        packed = torch.from_numpy(np.concatenate(seqs)).long()[None]
        positions = torch.cat([torch.arange(m) for m in lengths])[None]
        layouts = {
            "one sequence per forward": lambda: [
                run(input_ids=torch.from_numpy(s).long()[None]) for s in seqs
            ],
            "right padding, no mask": lambda: run(input_ids=padded),
            "right padding + mask": lambda: run(input_ids=padded, attention_mask=mask),
            "packed + position ids": lambda: run(input_ids=packed, position_ids=positions),
        }
        print(f"\nforward of {n} sequences ({sum(lengths)} tokens) on {device}, {label}")
        print(f"{'layout':>26} | {'ms [lowest-highest]':>26} | {'max |diff| vs alone':>20}")
        for name, fn in layouts.items():
            out = fn()
            ms = Spread.of(wall_times(fn, repeats, cuda=device.startswith("cuda"))).scaled(1e3)
            print(f"{name:>26} | {ms.text():>26} | {_leak(name, out, alone, lengths):>20.2e}")


def build_tiny_hybrid(path: Path) -> Path:
    """A tiny Qwen3.5-architecture checkpoint: 3 linear-attention layers per full-attention
    layer."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision)
    ).save_pretrained(path)
    return path


def hybrid_table(path: Path) -> None:
    """Leak of right padding vs packing on a hybrid (linear + full attention) target."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(path).get_text_config()
    model = AutoModel.from_pretrained(path, config=config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (m,), generator=gen).numpy() for m in (60, 37)]
    lengths = [len(s) for s in seqs]

    def run(**kw):
        return model(**kw, use_cache=False).last_hidden_state

    with torch.inference_mode():
        alone = [run(input_ids=torch.from_numpy(s).long()[None])[0] for s in seqs]
        padded = run(input_ids=pad_right(seqs, 0))
        packed = run(
            input_ids=torch.from_numpy(np.concatenate(seqs)).long()[None],
            position_ids=torch.cat([torch.arange(m) for m in lengths])[None],
        )
    print("\nhybrid linear-attention target (tiny Qwen3.5 shape), float32")
    print(f"{'layout':>26} | {'max |diff| vs alone':>20}")
    print(f"{'right padding, no mask':>26} | {_leak('right', padded, alone, lengths):>20.2e}")
    print(f"{'packed + position ids':>26} | {_leak('packed', packed, alone, lengths):>20.2e}")


def _leak(name, out, alone, lengths) -> float:
    if name.startswith("one"):
        return 0.0
    if name.startswith("packed"):
        rows = torch.split(out[0], lengths)
    else:
        rows = [out[b, :m] for b, m in enumerate(lengths)]
    return max((r - a).abs().max().item() for r, a in zip(rows, alone))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes for a CPU smoke run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--qwen3-8b-layers",
        type=int,
        default=0,
        metavar="N",
        help="also time the layouts on N layers of Qwen3-8B's shape in bf16 (a GPU run)",
    )
    args = parser.parse_args()
    n, max_length, repeats = (8, 512, 3) if args.quick else (32, 3072, 7)
    padding_table(2048 if args.quick else 65536, budget=32768, max_length=3072)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = tiny_model(build_tiny_target(Path(tmp) / "tiny", TinySpec()), args.device)
        forward_table(tiny, "tiny target, float32", args.device, n, max_length, repeats)
        if args.qwen3_8b_layers:
            big = qwen3_8b_layers(args.device, args.qwen3_8b_layers)
            forward_table(
                big,
                f"{args.qwen3_8b_layers} layers of Qwen3-8B's shape, bf16, sdpa",
                args.device,
                n,
                max_length,
                repeats,
            )
            del big
        hybrid_table(build_tiny_hybrid(Path(tmp) / "hybrid"))


if __name__ == "__main__":
    main()
