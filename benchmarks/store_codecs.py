"""Storage codecs on a real target's hidden states: bytes per token, error per layer, speed.

    python benchmarks/store_codecs.py                  # the tiny target, on the CPU
    python benchmarks/store_codecs.py --target runs/quality/target --device cuda

The target (float32) runs over `--tokens` tokens of conversations (token records with `input_ids`,
or `messages` rendered by the target's chat template; default: TARGET/prompts/train.jsonl where it
exists, else data/tiny-train.jsonl), and every decoder layer's output (layer id i = HF
hidden_states[i + 1]) plus the final normed state is put through each codec. Printed:

1. per codec: stored bytes per token and layer (codes, scales and per-token metadata) as a fraction
   of bf16's, and the relative L2 error per layer, the mean over tokens of ||decoded - x|| / ||x||
   against the float32 states (bf16 itself is not exact: its row is the rounding error). The
   store's dtypes (bf16, fp8_e4m3, q4_hadamard) go through dflash_common/store/quant.py; the other
   rows are the 4-bit variants measured to choose q4_hadamard, through this script's reference
   quantiser (with q4_hadamard's own settings it reproduces quant.py's codes, checked at start);
2. bytes per token of the drafter's layers (DFlash's K) and of every layer, per store dtype;
3. median (lowest-highest) over `--repeats` of the encode and decode time of one layer's [T, H]
   states per store dtype on `--device` (on CUDA, q4_hadamard decodes with the Triton kernel, and
   once more with the torch decoder), and the two forms of the Hadamard transform.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import Spread, wall_times  # noqa: E402
from dflash_common.store import quant  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STORE_DTYPES = ("bf16", "fp8_e4m3", "q4_hadamard")
NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823029,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)  # QLoRA's normal-float levels
# FP4: 15 values
E2M1 = tuple(v / 6 for v in (-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6))
INT4 = tuple(v / 7 for v in range(-7, 8))  # uniform, symmetric
BOOKS = {"q4": quant.Q4_LEVELS, "nf4": NF4, "e2m1": E2M1, "int4": INT4}
# name -> (codebook, group, scale format, rotate, scale candidates); the first: q4_hadamard's own
VARIANTS = {
    "q4 g16 e4m3 rot search (= q4_hadamard)": ("q4", 16, "e4m3", True, 2),
    "q4 g16 e4m3 rot": ("q4", 16, "e4m3", True, 1),
    "q4 g16 e4m3 (no rotation)": ("q4", 16, "e4m3", False, 2),
    "q4 g32 e4m3 rot search": ("q4", 32, "e4m3", True, 2),
    "q4 g32 bf16 rot": ("q4", 32, "bf16", True, 1),
    "q4 g16 bf16 rot (over 0.30x)": ("q4", 16, "bf16", True, 1),
    "nf4 g16 e4m3 rot search": ("nf4", 16, "e4m3", True, 2),
    "nf4 g16 e4m3 rot": ("nf4", 16, "e4m3", True, 1),
    "nf4 g32 bf16 rot": ("nf4", 32, "bf16", True, 1),
    "int4 g16 e4m3 rot": ("int4", 16, "e4m3", True, 1),
    "e2m1 g16 e4m3 rot": ("e2m1", 16, "e4m3", True, 1),
    "e2m1 g16 e4m3 (NVFP4-like)": ("e2m1", 16, "e4m3", False, 1),
    "e2m1 g32 e8m0 (MXFP4-like)": ("e2m1", 32, "e8m0", False, 1),
    "e2m1 g32 e8m0 rot": ("e2m1", 32, "e8m0", True, 1),
}


def variant_bytes(hidden: int, group: int, scale: str) -> int:
    """Stored bytes per token and layer: codes, group scales, and (e4m3 group scales) the float32
    scale per token."""
    per_group = {"e4m3": 1, "e8m0": 1, "bf16": 2}[scale]
    return hidden // 2 + per_group * hidden // group + (4 if scale == "e4m3" else 0)


def variant_round_trip(
    x: torch.Tensor, book: str, group: int, scale: str, rotate: bool, candidates: int
) -> torch.Tensor:
    """x [T, H] float32 -> decoded [T, H] through one 4-bit variant (a reference: unchunked)."""
    t, h = x.shape
    levels = torch.tensor(BOOKS[book], device=x.device)
    top = float(levels.abs().max())
    y = quant.hadamard(x) if rotate else x
    groups = y.reshape(t, h // group, group)
    amax = groups.abs().amax(dim=2)  # [T, n]
    if (
        scale == "e4m3"
    ):  # a group's step: an e4m3 code (at least amax/top) times a float32 per token
        outer = amax.amax(dim=1) / torch.full_like(amax[:, 0], top * quant.FP8_E4M3_MAX)
        outer = torch.where(outer > 0, outer, torch.ones_like(outer))
        ratio = (amax / (outer * top)[:, None]).clamp(max=quant.FP8_E4M3_MAX)
        up = quant._e4m3_code_at_least(ratio)
        if candidates == 1:  # the nearest code, whatever it clips
            up = ratio.to(torch.float8_e4m3fn).view(torch.uint8)
        codes = [(up.int() - k).clamp(min=0).to(torch.uint8) for k in range(candidates)]
        steps = [c.view(torch.float8_e4m3fn).float() * outer[:, None] for c in codes]
    elif scale == "bf16":
        steps = [(amax / top).bfloat16().float()]
    else:  # e8m0: a power of two, rounded up
        steps = [torch.exp2(torch.ceil(torch.log2((amax / top).clamp_min(2.0**-126))))]
    best, best_err = None, None
    for step in steps:
        divisor = torch.where(step > 0, step, torch.full_like(step, math.inf))
        mids = (levels[1:] + levels[:-1]) / 2
        back = levels[torch.bucketize(groups / divisor[..., None], mids)] * step[..., None]
        err = (back - groups).square().sum(dim=2)
        if best is None:
            best, best_err = back, err
        else:
            lower = err < best_err
            best, best_err = (
                torch.where(lower[..., None], back, best),
                torch.where(lower, err, best_err),
            )
    out = best.reshape(t, h)
    return quant.hadamard_by_matmul(out) if rotate else out


def relative_l2(decoded: torch.Tensor, x: torch.Tensor) -> float:
    """Mean over tokens of ||decoded - x|| / ||x|| (all-zero tokens left out)."""
    norm = x.norm(dim=1)
    keep = norm > 0
    return float(((decoded - x).norm(dim=1)[keep] / norm[keep]).mean())


def store_round_trip(x: torch.Tensor, dtype: str) -> torch.Tensor:
    enc = quant.encode_states(x, dtype)
    return quant.decode_states(enc.data, enc.scale, dtype, out_dtype=torch.float32)


# -------------------------------------------------------------------------------------- states


def load_tokens(target: Path, data: Path | None, tokens: int) -> list[list[int]]:
    """Token ids of conversations, up to `tokens` in all (whole conversations, the last one cut)."""
    from transformers import AutoTokenizer

    if data is None:
        prompts = target / "prompts" / "train.jsonl"
        data = prompts if prompts.is_file() else ROOT / "data" / "tiny-train.jsonl"
    tok = AutoTokenizer.from_pretrained(target)
    out, total = [], 0
    for line in data.read_text().splitlines():
        if total >= tokens:
            break
        if not line.strip():
            continue
        record = json.loads(line)
        if "input_ids" not in record:  # rendered, then tokenized: one path on every transformers
            text = tok.apply_chat_template(record["messages"], tokenize=False)
            record["input_ids"] = tok(text, add_special_tokens=False)["input_ids"]
        ids = list(record["input_ids"])[: tokens - total]
        out.append(ids)
        total += len(ids)
    if not out:
        raise SystemExit(f"{data} holds no conversation")
    return out


@torch.no_grad()
def target_states(target: Path, sequences: list[list[int]], device: str) -> dict[str, torch.Tensor]:
    """{'L<i>': layer i's output, ..., 'final': the final normed state}, float32 [T, H] each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()
    per_layer: dict[str, list[torch.Tensor]] = {}
    for ids in sequences:
        hidden = model(torch.tensor([ids], device=device), output_hidden_states=True).hidden_states
        # [i + 1]: layer i; [-1]: normed
        names = [f"L{i}" for i in range(len(hidden) - 2)] + ["final"]
        for name, h in zip(names, hidden[1:]):
            per_layer.setdefault(name, []).append(h[0].float())
    return {k: torch.cat(v) for k, v in per_layer.items()}


def tiny_target_dir() -> Path:
    from dflash_common.tiny import build_tiny_target

    return build_tiny_target(ROOT / ".cache" / "tiny-target")


# -------------------------------------------------------------------------------------- tables


def error_table(states: dict[str, torch.Tensor], variants: list[str]) -> list[str]:
    hidden = next(iter(states.values())).shape[1]
    names = list(states)
    lines = [
        "| codec | bytes/token vs bf16 | " + " | ".join(names) + " | mean |",
        "|---|---|" + "---|" * (len(names) + 1),
    ]
    rows = [
        (d, quant.token_bytes(d, hidden), lambda x, d=d: store_round_trip(x, d))
        for d in STORE_DTYPES
    ]
    rows += [
        (
            v,
            variant_bytes(hidden, *VARIANTS[v][1:3]),
            lambda x, v=v: variant_round_trip(x, *VARIANTS[v]),
        )
        for v in variants
    ]
    for name, nbytes, fn in rows:
        errs = [relative_l2(fn(x), x) for x in states.values()]
        cells = " | ".join(f"{e:.4f}" for e in errs)
        lines.append(
            f"| {name} | {nbytes / (2 * hidden):.3f} | {cells} | {sum(errs) / len(errs):.4f} |"
        )
    return lines


def bytes_table(hidden: int, num_layers: int, k: int) -> list[str]:
    lines = [
        "| store dtype | K layers | bytes/token | every layer | bytes/token |",
        "|---|---|---|---|---|",
    ]
    for d in STORE_DTYPES:
        per = quant.token_bytes(d, hidden)
        lines.append(f"| {d} | {k} | {k * per + 5:,} | {num_layers} | {num_layers * per + 5:,} |")
    return lines


def speed_table(hidden: int, tokens: int, device: str, repeats: int) -> list[str]:
    cuda = device.startswith("cuda")
    x = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
    lines = [
        f"| store dtype | encode ms [T={tokens}, H={hidden}] | decode ms (to bf16) |",
        "|---|---|---|",
    ]
    for d in STORE_DTYPES:
        enc = quant.encode_states(x, d)
        e = Spread.of(wall_times(lambda: quant.encode_states(x, d), repeats, 1, cuda)).scaled(1e3)
        dec = Spread.of(
            wall_times(lambda: quant.decode_states(enc.data, enc.scale, d), repeats, 1, cuda)
        )
        lines.append(f"| {d} | {e.text('.2f')} | {dec.scaled(1e3).text('.2f')} |")
        if d == "q4_hadamard" and cuda:  # the row above is the Triton kernel's ("auto" on CUDA)
            torch_decode = lambda: quant.decode_states(enc.data, enc.scale, d, backend="torch")  # noqa: E731
            dec = Spread.of(wall_times(torch_decode, repeats, 1, cuda))
            lines.append(f"| {d}, torch decoder | | {dec.scaled(1e3).text('.2f')} |")
    y = x.float()
    for name, fn in (
        ("hadamard (butterflies: encode)", quant.hadamard),
        ("hadamard_by_matmul (decode)", quant.hadamard_by_matmul),
    ):
        t = Spread.of(wall_times(lambda: fn(y), repeats, 1, cuda)).scaled(1e3)
        lines.append(f"| {name} | {t.text('.2f')} | |")
    return lines


def check_reference(x: torch.Tensor) -> None:
    """The reference quantiser with q4_hadamard's settings decodes as quant.py does (but for groups
    whose two candidate scales tie to the last bit: its error sums run in another order)."""
    want = store_round_trip(x, "q4_hadamard")
    got = variant_round_trip(x, *next(iter(VARIANTS.values())))
    off = float(((got - want).abs() > 1e-5 * want.abs().max()).float().mean())
    if off > 1e-3:
        raise SystemExit(
            f"the reference quantiser differs from quant.py's q4_hadamard in {off:.2%} of values"
        )


def synthetic_states(hidden: int, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Stand-ins where no target of that size is at hand (labelled so in the output): 'normal'
    N(0, 1); 'channels' per-channel scales exp(N(0, 0.5^2)) and 4 channels offset by +-20;
    'massive' the same with one channel at 1000 in 1% of the tokens (massive activations)."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(tokens, hidden, generator=g)
    offset = torch.zeros(hidden)
    chosen = torch.randperm(hidden, generator=g)[:4]
    offset[chosen] = 20 * torch.randn(4, generator=g).sign()
    channels = torch.randn(tokens, hidden, generator=g) * torch.exp(
        0.5 * torch.randn(hidden, generator=g)
    )
    channels += offset
    massive = channels.clone()
    massive[torch.rand(tokens, generator=g) < 0.01, chosen[0]] = 1000.0
    return {"normal": normal, "channels": channels, "massive": massive}


def print_tables(states, variants, header: str, layers: int | None, args) -> None:
    first = next(iter(states.values()))
    hidden = first.shape[1]
    check_reference(first)
    print(
        f"{header}, {first.shape[0]} tokens, device {args.device}, torch {torch.__version__}, "
        f"{platform.node()}\n"
    )
    print("\n".join(error_table(states, variants)))
    print(
        "\nrelative L2 error: mean over tokens of ||decoded - x|| / ||x||, x the float32 states"
        + ("; L<i>: output of decoder layer i; final: the final normed state\n" if layers else "\n")
    )
    if layers:
        from precompute.target import resolve_layer_ids

        k = len(resolve_layer_ids(None, layers))
        print("\n".join(bytes_table(hidden, layers, k)))
        print(
            f"\n(K = {k}: DFlash's layer ids for this target; + 5 bytes per token for the token "
            "id and loss mask)\n"
        )
    speed = speed_table(args.speed_hidden or hidden, args.speed_tokens, args.device, args.repeats)
    print("\n".join(speed))
    print(f"\nmedian [lowest-highest] of {args.repeats} runs after one warm-up")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=None, help="HF target (default: the tiny target)")
    p.add_argument(
        "--data", type=Path, default=None, help="JSONL of token records or chat messages"
    )
    p.add_argument("--tokens", type=int, default=8192, help="tokens of states per layer")
    p.add_argument(
        "--synthetic",
        type=int,
        default=0,
        help="no target: synthetic states of this hidden size (synthetic_states)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per speed figure")
    p.add_argument("--speed-tokens", type=int, default=4096, help="T of the speed table")
    p.add_argument(
        "--speed-hidden", type=int, default=0, help="H of the speed table (0: the states')"
    )
    p.add_argument(
        "--variants", default="all", help="comma list of VARIANTS names, 'all' or 'none'"
    )
    args = p.parse_args(argv)
    named = {"all": list(VARIANTS), "none": []}
    variants = named[args.variants] if args.variants in named else args.variants.split(",")
    if args.synthetic:
        states = {
            k: v.to(args.device) for k, v in synthetic_states(args.synthetic, args.tokens).items()
        }
        print_tables(states, variants, f"synthetic states, hidden {args.synthetic}", None, args)
        return
    target = args.target or tiny_target_dir()
    states = target_states(target, load_tokens(target, args.data, args.tokens), args.device)
    # L0 .. L(N-2) and the final state: HF's last hidden state is normed (layer N-1's output is not)
    hidden = next(iter(states.values())).shape[1]
    header = f"target {target} (hidden {hidden}, {len(states)} layers)"
    print_tables(states, variants, header, len(states), args)


if __name__ == "__main__":
    main()
