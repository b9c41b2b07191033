"""dflash-eval's decoding, batched (train/eval/batched.py) against one prompt at a time.

    python benchmarks/eval_batched.py --quick         # CPU: the tiny target, a smoke run
    python benchmarks/eval_batched.py                 # GPU: the quality benchmark's small target
    python benchmarks/eval_batched.py --shape rich    # ... its rich regime's (~36M parameters)
    python benchmarks/eval_batched.py --target DIR [--drafter DIR] [--prompts FILE.jsonl]

Each loop decodes what dflash-eval decodes for a report: every prompt with the drafter, then with
the target alone, then the lossless comparison (train/eval/run.py `decode_prompts`, greedy, no stop
token unless --prompts gives real ones, so every prompt runs to --max-new-tokens). Without --target
the target is a Qwen3 of the quality benchmark's shape (benchmarks/quality/target.py) with random
weights, and without --drafter a random DFlash drafter (depth 3, block 16): it accepts almost
nothing, so every prompt takes the most cycles there are, the slowest case. Prompts are random
tokens, lengths uniform in [--prompt-len / 2, --prompt-len], unless --prompts names a dflash-eval
prompt file (with --target).

Rows: seconds for all --num-prompts prompts, the median of --repeats runs after one untimed warm-up,
[lowest-highest] beside it; new tokens/s (speculative and target-alone tokens together); the batched
loop's speedup. The one-at-a-time loop is timed on the first --single-prompts prompts and scaled to
all of them (marked), as it takes minutes on a GPU. The last line says whether the batched loop gave
every timed prompt the one-at-a-time loop's cycles and tokens, and the tau both measured.
Goal (issue 41): 200 prompts x 128 tokens in <= 30 s on one GPU for the quality benchmark's targets.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == ROOT / "benchmarks":
    sys.path[0] = str(ROOT)  # benchmarks/precompute.py would shadow the precompute package

from benchmarks.timing import Spread  # noqa: E402

# benchmarks/quality/target.py's regimes (8 layers, head_dim 64, vocab 8192, tied embeddings)
SHAPES = {
    "small": dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=768
    ),
    "rich": dict(
        hidden_size=512, num_attention_heads=8, num_key_value_heads=4, intermediate_size=2048
    ),
}


def build_target(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **SHAPES[shape],
        num_hidden_layers=8,
        head_dim=64,
        vocab_size=8192,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(dtype).eval()


def tiny_target(device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from dflash_common.tiny import build_tiny_target

    path = build_tiny_target(Path(tempfile.gettempdir()) / "dflash-bench-tiny-target")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval(), path


def random_proposer(model, block_size: int, depth: int):
    from dflash_common.drafter.config import DrafterConfig
    from dflash_common.drafter.model import DFlashDrafter
    from train.eval.load import attach_target

    cfg = DrafterConfig.from_target(
        model.config, mask_token_id=model.config.vocab_size - 1, depth=depth, block_size=block_size
    )
    torch.manual_seed(1)
    weight = next(model.parameters())
    return attach_target(DFlashDrafter(cfg).to(weight.device, weight.dtype).eval(), model)


def random_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, length // 2), length + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab - 1, (k,), generator=g).tolist() for k in lengths]


def decode(target, proposer, prompts, settings) -> tuple[float, list]:
    """Seconds of one decode_prompts call (what dflash-eval times), and its results."""
    from train.eval.run import decode_prompts

    start = target.clock()
    results = decode_prompts(target, proposer, prompts, settings, warmup=False)
    return target.clock() - start, results


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--target", default="", help="an HF target directory (default: a random --shape target)"
    )
    p.add_argument(
        "--drafter",
        default="",
        help="an exported drafter for it (default: a random DFlash drafter)",
    )
    p.add_argument(
        "--prompts", default="", help="a dflash-eval prompt file (needs --target's tokenizer)"
    )
    p.add_argument(
        "--shape", default="small", choices=sorted(SHAPES), help="the random target's shape"
    )
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=240, help="longest random prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="prompts a batch; 0: dflash-eval's choice on a GPU",
    )
    p.add_argument(
        "--single-prompts", type=int, default=20, help="prompts the one-at-a-time loop is timed on"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--quick", action="store_true", help="the tiny target on the CPU, few prompts: a smoke run"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.prompt_len = 8, 24, 40
        args.block_size, args.single_prompts, args.repeats = 4, 8, 3
    args.single_prompts = min(args.single_prompts, args.num_prompts)
    return args


def setup(args):
    """(target runner, proposer, prompts, stop ids, device name)."""
    from dflash_common.hf import stop_token_ids, torch_dtype
    from train.eval.load import load_proposer
    from train.eval.prompts import load_prompts
    from train.eval.spec_decode import TargetRunner

    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype, stops, prompts = torch_dtype(args.dtype), frozenset(), None
    if args.quick:
        model, path = tiny_target(device, dtype)
    elif args.target:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
        if args.prompts:
            tok = AutoTokenizer.from_pretrained(args.target)
            prompts = [p.ids for p in load_prompts([args.prompts], tok, {}, args.num_prompts)]
            stops = stop_token_ids(model.generation_config, tok)
    else:
        model = build_target(args.shape, device, dtype)
    proposer = (
        load_proposer(args.drafter, model)
        if args.drafter
        else random_proposer(model, args.block_size, 3)
    )
    if prompts is None:
        prompts = random_prompts(args.num_prompts, args.prompt_len, model.config.vocab_size)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return TargetRunner(model, proposer.layer_ids), proposer, prompts, stops, name


def main(argv=None) -> None:
    from train.eval import batched
    from train.eval.prompts import Prompt
    from train.eval.run import Settings
    from dflash_common.sampling import Sampling

    args = parse(argv)
    target, proposer, ids, stops, device = setup(args)
    items = [Prompt(f"p{i}", ids=p) for i, p in enumerate(ids)]
    rows = args.batch_size or (batched.AUTO_ROWS if target.device.type == "cuda" else len(items))
    greedy = Sampling(max_new_tokens=args.max_new_tokens)
    batch = Settings(args.block_size, greedy, stops, True, True, batch_size=rows)
    single = Settings(args.block_size, greedy, stops, True, True, batch_size=1)
    params = sum(p.numel() for p in target.model.parameters())
    print(
        f"{device}, {args.dtype}, target {params / 1e6:.1f}M parameters, {len(items)} prompts x "
        f"{args.max_new_tokens} new tokens, block {args.block_size}, torch {torch.__version__}",
        flush=True,
    )
    few = items[: args.single_prompts]
    decode(
        target,
        proposer,
        items[: min(len(items), rows)],
        Settings(  # warm-up, untimed
            args.block_size,
            Sampling(max_new_tokens=min(args.max_new_tokens, 2 * args.block_size)),
            stops,
            True,
            True,
            batch_size=rows,
        ),
    )
    decode(target, proposer, few[:1], single)
    batched_s, single_s = [], []
    for _ in range(args.repeats):  # interleaved: a drifting clock weighs on both alike
        seconds, together = decode(target, proposer, items, batch)
        batched_s.append(seconds)
        seconds, alone = decode(target, proposer, few, single)
        single_s.append(seconds * len(items) / len(few))
    new = sum(len(r.spec.tokens) + len(r.target.tokens) for r in together)
    b, s = Spread.of(batched_s), Spread.of(single_s)
    scaled = "" if len(few) == len(items) else f" (timed on {len(few)}, scaled)"
    print(f"| loop | s for {len(items)} prompts | new tokens/s | speedup |")
    print("|---|---|---|---|")
    print(
        f"| batched (up to {rows} a batch) | {b.text('.2f')} | {b.per(new).text(',.0f')} | "
        f"{s.median / b.median:.1f}x |"
    )
    print(f"| one at a time{scaled} | {s.text('.2f')} | {s.per(new).text(',.0f')} | 1.0x |")
    same = all(
        (x.spec.tokens, x.spec.acceptance_lengths) == (y.spec.tokens, y.spec.acceptance_lengths)
        for x, y in zip(together, alone)
    )
    lossless = all(r.first_mismatch is None for r in together)
    taus = [sum(r.spec.acceptance_lengths) / len(r.spec.acceptance_lengths) for r in together]
    print(
        f"same tokens and cycles as one at a time on the {len(few)} prompts both decoded: "
        f"{'yes' if same else 'NO'}; lossless: {'yes' if lossless else 'NO'}; "
        f"tau {sum(taus) / len(taus):.3f}; {time.strftime('%Y-%m-%d')}"
    )


if __name__ == "__main__":
    main()
