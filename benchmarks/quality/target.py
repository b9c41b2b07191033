"""Quality benchmark, stage 1: build a small but real target LM from a seed, with no download.

    python benchmarks/quality/target.py --out runs/quality/target   # H200: ~5 min, 4 of training
    python benchmarks/quality/target.py --out /tmp/t --device cpu --corpus-mb 1 --bpe-train-mb 1 \\
        --vocab-size 1024 --hidden 64 --heads 1 --kv-heads 1 --intermediate 128 --seq-len 64 \\
        --batch 4 --steps 6 --warmup-steps 2 --eval-rows 8 --heldout-frac 0.1 --train-prompts 30 \\
        --heldout-prompts 10 --report-prompts 4 --max-new-tokens 24 \\
        --loop-window 16                                           # tiny: < 1 min, 2 CPUs

Drafter quality (acceptance length) can only be measured on a target whose greedy answers are real
text: a random-weight target answers with noise no drafter can learn. This stage trains one, about
8M parameters, on the one corpus every machine has: the Python sources of the running interpreter.

1. Corpus: `*.py` under the interpreter's purelib, platlib and stdlib, ordered by a hash of (seed,
   relative path), read until --corpus-mb; files that are not UTF-8, duplicate another file's bytes
   or contain a chat special token are skipped. A hash of the relative path alone puts
   --heldout-frac of the files into the held-out split, so the split does not move with the seed.
   corpus_files.jsonl lists every file used (path, sha256, split); the manifest holds their hash.
2. Tokenizer: byte-level BPE (`tokenizers`, --vocab-size) trained on training files, with the
   special tokens <|endoftext|> (0, pad), <|im_start|> (1), <|im_end|> (2, eos) and <|mask|> (3: the
   DFlash MASK token, absent from every training text), wrapped as PreTrainedTokenizerFast with a
   Qwen-style chat template whose `{% generation %}` markers give transformers' assistant mask.
3. Data: chat samples "complete the function": the user turn holds up to --context-chars of the file
   before a `def` plus its signature, the assistant turn the function's body (<= --answer-chars),
   ended by <|im_end|>, so the target learns to stop where the function ends. Each training file
   also goes in whole as plain text. Documents are shuffled, joined with <|endoftext|> and cut into
   rows of --seq-len.
4. Model: Qwen3ForCausalLM (8 layers, hidden 256, 4 heads of head_dim 64 (vLLM's CPU attention
   refuses 16), 2 kv heads, SwiGLU 768, tied embeddings, rope_theta 10000, 4096 positions), trained
   with AdamW, warmup + cosine, bf16 autocast on CUDA (fp32 on the CPU), for --steps (or --minutes).
   On one H200 (eager): corpus 12 s, BPE 3 s, tokenizing 394 MB of documents 21 s (110M tokens),
   3600 steps ~4 min at ~1.0M tok/s; held-out loss ~1.87 (ppl ~6.5); of 100 greedy held-out answers
   ~3% end in a token loop and ~74% end with <|im_end|> (mean ~62 tokens). --compile: ~2.4M tok/s.
5. Report (float32): held-out loss and perplexity; greedy answers to the first --report-prompts
   held-out prompts: how many end in a loop (the last --loop-window tokens repeat with a period of
   at most --loop-max-period tokens), how many end by repeating one line 3 times, how many end with
   <|im_end|>. A table on stdout, report.json on disk.
6. Output (--out, HF layout): config.json (with top-level rope_theta), model.safetensors (bf16: the
   weights are rounded to bf16 after training, and the report is measured on the rounded weights),
   generation_config.json (eos <|im_end|>, greedy), tokenizer files and chat template,
   manifest.json, report.json, train_log.jsonl, corpus_files.jsonl, and the prompts of the next
   stage in OpenAI `messages` JSONL: prompts/train.jsonl (from training files; functions kept out of
   the chat samples) and prompts/heldout.jsonl (from held-out files). Everything is built in
   OUT.partial and renamed into place; a directory whose manifest holds the same settings is reused,
   not rebuilt.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
import sysconfig
import time
import typing
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# Qwen3's chat tokens, plus DFlash's MASK token. Trained first, so their ids are 0..3 at any vocab
# size.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
EOT, IM_START, IM_END, MASK = SPECIAL_TOKENS
# The template of dflash_common/tiny.py (copied, not imported: this script must run from any
# checkout).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2/3's pre-tokenizer split. Unlike GPT-2's, it keeps a newline apart from the next line's
# indentation, so the template's "assistant\n" is one token whether or not an answer follows: the
# prompt of a greedy answer ends with the same token as in training, and assistant masks do not
# start a character early.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PROMPT_PREFIX = "Complete the function:\n"
PROMPT_MIN_ANSWER_CHARS = 64  # a one-line body leaves a drafter next to nothing to draft
MAX_POSITIONS = 4096  # beyond --seq-len: prompt + answer of the later stages must fit
ROPE_THETA = 10000.0
CALIBRATION_STEPS = (
    10  # --minutes: steps timed (after the first 3, which compile/warm up) to fix the total
)
GEN_BATCH = 64  # greedy report prompts per generate() call
# stdlib holds the base interpreter's packages
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}
# Settings that do not change what is built (the cache compares all the others).
NOT_SETTINGS = {"out", "force", "log_every", "workers"}


def _opt(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    out: str = _opt(
        "", "output directory (required); reused when its manifest holds the same settings"
    )
    seed: int = _opt(0, "seed of file selection, shuffling, initialisation and batch order")
    device: str = _opt("auto", "cuda, cpu, or auto (cuda when available)")
    corpus_mb: float = _opt(200.0, "MB of Python source read (train + held-out)")
    heldout_frac: float = _opt(
        0.02, "fraction of files held out (by a hash of their relative path)"
    )
    max_file_kb: int = _opt(256, "larger files are skipped (mostly generated tables)")
    vocab_size: int = _opt(
        8192, "BPE vocabulary, special tokens included; also the model's vocab_size"
    )
    bpe_train_mb: float = _opt(50.0, "MB of training files the BPE is trained on")
    context_chars: int = _opt(600, "chars of the file before a def given in its prompt")
    answer_chars: int = _opt(1200, "longest function body used as an answer (chars)")
    plain_text: bool = _opt(True, "also train on every training file as plain text")
    hidden: int = _opt(256, "hidden size")
    layers: int = _opt(8, "decoder layers (8 make DFlash's 5 target layer ids distinct)")
    heads: int = _opt(4, "attention heads")
    kv_heads: int = _opt(2, "key/value heads")
    head_dim: int = _opt(64, "head dim (vLLM's CPU attention refuses 16)")
    intermediate: int = _opt(768, "SwiGLU intermediate size")
    seq_len: int = _opt(512, "tokens per training row")
    batch: int = _opt(128, "rows per step")
    # 3600 x 62 ms (eager, batch 128 x 512 on one H200: ~1.0M tok/s) = ~4 min; --compile runs them
    # ~2.4x faster
    steps: int = _opt(3600, "optimizer steps (ignored when --minutes is given)")
    minutes: float | None = _opt(
        None, "train this long instead of --steps (count fixed after 10 timed steps)"
    )
    warmup_steps: int = _opt(100, "linear warmup steps, then cosine decay")
    lr: float = _opt(2e-3, "peak learning rate")
    min_lr_frac: float = _opt(0.1, "final learning rate as a fraction of --lr")
    weight_decay: float = _opt(0.1, "AdamW weight decay of matrices (norms decay none)")
    grad_clip: float = _opt(1.0, "gradient-norm clip")
    compile: bool = _opt(False, "torch.compile the model for training")
    eval_rows: int = _opt(512, "held-out rows of --seq-len tokens for the held-out loss")
    train_prompts: int = _opt(8000, "prompts written from training files (prompts/train.jsonl)")
    heldout_prompts: int = _opt(300, "prompts written from held-out files (prompts/heldout.jsonl)")
    report_prompts: int = _opt(100, "held-out prompts answered greedily for the report")
    max_new_tokens: int = _opt(128, "longest greedy answer of the report")
    loop_window: int = _opt(64, "an answer loops when its last N tokens ...")
    loop_max_period: int = _opt(8, "... repeat with a period of at most this many tokens")
    log_every: int = _opt(50, "steps between log lines")
    workers: int = _opt(0, "processes parsing sources (0: one per CPU)")
    force: bool = _opt(False, "rebuild even when --out holds another target")

    def __post_init__(self):
        # --minutes times steps inside the warmup
        warmup_ok = (
            self.warmup_steps < self.steps
            if self.minutes is None
            else self.warmup_steps >= CALIBRATION_STEPS
        )
        checks = {  # field: (valid, what it must be)
            "out": (bool(self.out), "a directory"),
            "device": (self.device in ("auto", "cuda", "cpu"), "cuda, cpu or auto"),
            "heldout_frac": (0 < self.heldout_frac < 1, "between 0 and 1"),
            "head_dim": (self.hidden == self.heads * self.head_dim, "--hidden / --heads"),
            "kv_heads": (
                self.kv_heads > 0 and self.heads % self.kv_heads == 0,
                "a divisor of --heads",
            ),
            "vocab_size": (
                self.vocab_size > 256 + len(SPECIAL_TOKENS),
                "above 260 (bytes + special tokens)",
            ),
            "seq_len": (0 < self.seq_len < MAX_POSITIONS, f"below {MAX_POSITIONS}"),
            "warmup_steps": (
                warmup_ok,
                f"below --steps, or at least {CALIBRATION_STEPS} with --minutes",
            ),
            "loop_window": (
                self.loop_max_period < self.loop_window <= self.max_new_tokens,
                "above --loop-max-period and at most --max-new-tokens",
            ),
            "report_prompts": (
                self.report_prompts <= self.heldout_prompts,
                "at most --heldout-prompts",
            ),
        }
        for name, (ok, must) in checks.items():
            if not ok:
                value = dataclasses.asdict(self)[name]
                raise ValueError(f"--{name.replace('_', '-')} {value!r}: must be {must} here")

    def settings(self, device: str) -> dict:
        """What the cache compares: every field that changes the result, and the device it ran
        on."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in NOT_SETTINGS}
        return {**fields, "device": device, "python": sys.version.split()[0], "weights": "bf16"}


# ------------------------------------------------------------------------------------------- corpus


@dataclasses.dataclass(frozen=True)
class SourceFile:
    rel: str  # "<root label>/<path under the root>": the same on every machine with that package
    text: str
    sha256: str
    heldout: bool


def _unit_hash(*parts) -> float:
    """A stable pseudo-random number in [0, 1) from its parts (Python's hash() is salted per
    process)."""
    digest = hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def corpus_roots() -> list[tuple[str, Path]]:
    """The running interpreter's package and stdlib dirs, each once (purelib and platlib often
    coincide)."""
    paths, roots = sysconfig.get_paths(), []
    for label in ("purelib", "platlib", "stdlib"):
        root = Path(paths[label]).resolve()
        if root.is_dir() and root not in [r for _, r in roots]:
            roots.append((label, root))
    return roots


def list_candidates(max_bytes: int) -> list[tuple[str, Path]]:
    """Every non-empty `*.py` of at most max_bytes under the roots, as (rel, path), sorted by
    rel."""
    found = []
    for label, root in corpus_roots():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in filenames:
                path = Path(dirpath, name)
                if name.endswith(".py") and path.is_file() and 0 < path.stat().st_size <= max_bytes:
                    found.append((f"{label}/{path.relative_to(root).as_posix()}", path))
    return sorted(found)


def read_source(path: Path) -> tuple[str | None, str, str]:
    """(text, sha256, why skipped): text with newlines normalised as `ast` counts lines, or None."""
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, digest, "not utf-8"
    if any(
        token in text for token in SPECIAL_TOKENS
    ):  # the tokenizer would read them as control tokens
        return None, digest, "holds a special token"
    return text.replace("\r\n", "\n").replace("\r", "\n"), digest, ""


def select_corpus(cfg: TargetConfig) -> tuple[list[SourceFile], dict]:
    """Files in (seed, path)-hash order until --corpus-mb, split by a hash of the path alone."""
    candidates = list_candidates(cfg.max_file_kb * 1024)
    order = sorted(candidates, key=lambda c: _unit_hash(cfg.seed, "select", c[0]))
    files, seen, skipped, total = [], set(), Counter(), 0
    for rel, path in order:
        if total >= cfg.corpus_mb * 1e6:
            break
        text, digest, why = read_source(path)
        why = why or ("duplicate" if digest in seen else "")
        if why:
            skipped[why] += 1
            continue
        seen.add(digest)
        files.append(SourceFile(rel, text, digest, _unit_hash("split", rel) < cfg.heldout_frac))
        total += len(text.encode())
    info = {
        "roots": [f"{label}={root}" for label, root in corpus_roots()],
        "candidates": len(candidates),
        "bytes": total,
        "skipped": dict(skipped),
    }
    return files, info


def corpus_record(files: list[SourceFile]) -> tuple[list[dict], str]:
    """The per-file record written to corpus_files.jsonl, and one hash of it for the manifest."""
    rows = [
        {"path": f.rel, "sha256": f.sha256, "split": "heldout" if f.heldout else "train"}
        for f in sorted(files, key=lambda f: f.rel)
    ]
    digest = hashlib.sha256(
        "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
    ).hexdigest()
    return rows, digest


# ------------------------------------------------------------------------------------------ samples


def function_spans(text: str) -> list[tuple[int, int, int]]:
    """(def line, first body line, end line), 0-based and end-exclusive, of every function whose
    body starts on a line of its own; [] for a file `ast` cannot parse (it still serves as plain
    text)."""
    try:
        with warnings.catch_warnings():
            # invalid escapes and the like: SyntaxWarnings, not errors
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines, spans = text.split("\n"), []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0]
        body_line = lines[first.lineno - 1]
        # `def f(a,\n b): return a`: the body shares a line with the signature; not a clean split
        if (
            first.lineno > node.lineno
            and len(body_line) - len(body_line.lstrip()) == first.col_offset
        ):
            spans.append((node.lineno - 1, first.lineno - 1, node.end_lineno))
    return sorted(spans)


def all_function_spans(files: list[SourceFile], workers: int) -> list[list[tuple[int, int, int]]]:
    """function_spans of every file; parsing 200 MB takes ~45 s on one core, so it runs in a
    pool."""
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(files) < 64:
        return [function_spans(f.text) for f in files]
    # fork: CUDA is not initialised yet, and tokenizers has not started its threads
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(function_spans, [f.text for f in files], chunksize=32)


def chat_pair(
    lines: list[str], span: tuple[int, int, int], cfg: TargetConfig
) -> tuple[str, str] | None:
    """(user, assistant) for one function: context + signature -> body; None when the body is too
    long."""
    def_i, body_i, end_i = span
    answer = "\n".join(lines[body_i:end_i]).rstrip()
    if len(answer) > cfg.answer_chars or not answer.strip():
        return None
    start, used = def_i, 0
    while start > 0 and used + len(lines[start - 1]) + 1 <= cfg.context_chars:
        start, used = start - 1, used + len(lines[start - 1]) + 1
    while start < def_i and not lines[start].strip():  # a prompt starts with code, not blank lines
        start += 1
    return PROMPT_PREFIX + "\n".join(lines[start:body_i]), answer


def render_chat(user: str, answer: str | None = None) -> str:
    """CHAT_TEMPLATE's text for one user turn (and answer), without Jinja: a million samples are
    rendered."""
    text = f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"
    return text if answer is None else f"{text}{answer}{IM_END}\n"


def function_pairs(files, spans, cfg) -> list[tuple[float, bool, str, str]]:
    """(prompt key, held out, user, answer) of every usable function; the key orders prompt
    selection."""
    pairs = []
    for f, file_spans in zip(files, spans):
        lines = f.text.split("\n")
        for span in file_spans:
            pair = chat_pair(lines, span, cfg)
            if pair is not None:
                pairs.append((_unit_hash(cfg.seed, "prompt", f.rel, span[0]), f.heldout, *pair))
    return pairs


def split_documents(files, pairs, cfg) -> dict:
    """Training and held-out documents, and the prompts of both splits (kept out of the chat
    samples)."""
    out = {}
    for split, heldout, n_prompts in (
        ("train", False, cfg.train_prompts),
        ("heldout", True, cfg.heldout_prompts),
    ):
        mine = sorted(p for p in pairs if p[1] == heldout)
        eligible = [i for i, p in enumerate(mine) if len(p[3]) >= PROMPT_MIN_ANSWER_CHARS][
            :n_prompts
        ]
        # held-out files are never trained anyway
        reserved = set(eligible) if split == "train" else set()
        docs = [
            render_chat(user, answer)
            for i, (_, _, user, answer) in enumerate(mine)
            if i not in reserved
        ]
        n_chat = len(docs)
        if cfg.plain_text or heldout:
            docs += [f.text for f in files if f.heldout == heldout]
        out[split] = {
            "docs": docs,
            "chat_samples": n_chat,
            "prompts": [mine[i][2] for i in eligible],
        }
    return out


# ---------------------------------------------------------------------------------------- tokenizer


def train_bpe(files: list[SourceFile], cfg: TargetConfig):
    """Byte-level BPE on the first --bpe-train-mb of training files; the special tokens get ids
    0..3."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, total = [], 0
    for f in files:
        if not f.heldout and total < cfg.bpe_train_mb * 1e6:
            texts.append(f.text)
            total += len(f.text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    return tok


def wrap_tokenizer(tok):
    """The transformers tokenizer saved with the model: eos <|im_end|>, pad <|endoftext|>, chat
    template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOT,
        additional_special_tokens=[IM_START, MASK],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_stream(tok, docs: list[str], seed: int) -> np.ndarray:
    """All documents, shuffled by the seed, tokenized in parallel batches, each ended by
    <|endoftext|>."""
    order = np.random.default_rng(seed).permutation(len(docs))
    eot = np.array([tok.token_to_id(EOT)], dtype=np.uint16)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets: ~2x faster
    pieces = []
    for start in range(0, len(docs), 8192):  # bounded batches: Encoding objects are heavy
        batch = [docs[i] for i in order[start : start + 8192]]
        for enc in encode(batch, add_special_tokens=False):
            pieces += [np.asarray(enc.ids, dtype=np.uint16), eot]  # vocab <= 65536
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def to_rows(stream: np.ndarray, seq_len: int) -> torch.Tensor:
    """[N*(T+1)] -> [N, T+1] int32: each row gives inputs [:-1] and next-token labels [1:]."""
    n = len(stream) // (seq_len + 1)
    return torch.from_numpy(stream[: n * (seq_len + 1)].astype(np.int32).reshape(n, seq_len + 1))


# ------------------------------------------------------------------------------------- model, train


def build_model(cfg: TargetConfig):
    """Qwen3ForCausalLM from a config, initialised from the seed."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=ROPE_THETA,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(EOT),
    )
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(config)


def make_optimizer(model, cfg: TargetConfig, device: str) -> torch.optim.AdamW:
    """AdamW; matrices decay, norm weights do not (decaying a gain towards 0 only fights the
    loss)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device == "cuda")


def lr_at(step: int, total: int | None, cfg: TargetConfig) -> float:
    """Linear warmup, then cosine to --min-lr-frac; total may be unknown (None) during the
    warmup."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (
        cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def batch_indices(n_rows: int, batch: int, seed: int):
    """Endless row indices: a fresh seeded permutation per epoch, the ragged tail dropped."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n_rows, generator=gen)
        for start in range(0, n_rows - batch + 1, batch):
            yield perm[start : start + batch]


def train_step(model, opt, rows: torch.Tensor, lr: float, cfg: TargetConfig, device: str):
    """One AdamW step on rows [B, T+1]; returns (loss, grad_norm) as tensors (no host sync)."""
    for group in opt.param_groups:
        group["lr"] = lr
    rows = rows.to(device, non_blocking=True).long()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(input_ids=rows[:, :-1]).logits  # [B, T, V]
    loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm


def planned_steps(cfg: TargetConfig, step_times: list[float]) -> int:
    """--minutes: the step count that fills the budget at the speed of the calibration steps."""
    # the first steps compile and warm up
    per_step = sum(step_times[3:]) / max(1, len(step_times) - 3)
    return max(cfg.warmup_steps + 1, int(cfg.minutes * 60 / per_step))


def train(model, rows: torch.Tensor, cfg: TargetConfig, device: str, log_path: Path) -> dict:
    """The training loop: fetch batch, step, log. Returns the step count, last loss and tokens/s."""
    step_model = torch.compile(model) if cfg.compile else model
    opt = make_optimizer(model, cfg, device)
    total = cfg.steps if cfg.minutes is None else None  # --minutes: fixed after CALIBRATION_STEPS
    batches, step_times, logged = batch_indices(len(rows), cfg.batch, cfg.seed), [], []
    rows = rows.to(device)  # [N, T+1] int32: the whole training set fits on the GPU
    model.train()
    t_start = t_log = t_step = time.perf_counter()
    with open(log_path, "w") as log:
        step = 0
        while total is None or step < total:
            lr = lr_at(step, total, cfg)
            loss, grad_norm = train_step(
                step_model, opt, rows[next(batches).to(device)], lr, cfg, device
            )
            step += 1
            if total is None:
                _sync(device)
                step_times.append(time.perf_counter() - t_step)
                t_step = time.perf_counter()
                total = planned_steps(cfg, step_times) if step == CALIBRATION_STEPS else None
            if step % cfg.log_every == 0 or step == total:
                since = step - (logged[-1]["step"] if logged else 0)
                logged.append(
                    _log_line(
                        step,
                        total,
                        loss,
                        grad_norm,
                        lr,
                        since,
                        cfg,
                        time.perf_counter() - t_log,
                        device,
                    )
                )
                log.write(json.dumps(logged[-1]) + "\n")
                t_log = time.perf_counter()
    seconds = time.perf_counter() - t_start
    tokens = step * cfg.batch * cfg.seq_len
    return {
        "steps": step,
        "final_loss": logged[-1]["loss"],
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _log_line(step, total, loss, grad_norm, lr, steps_since, cfg, seconds, device) -> dict:
    """One fixed-format line per logging step; the same figures go to train_log.jsonl."""
    tok_s = steps_since * cfg.batch * cfg.seq_len / max(seconds, 1e-9)
    mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    record = {
        "step": step,
        "loss": loss.item(),
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tok_s": tok_s,
        "mem_gib": mem,
    }
    print(
        f"step {step:6d}/{total} loss {record['loss']:.4f} lr {lr:.2e} "
        f"grad_norm {record['grad_norm']:.3f} "
        f"tok/s {tok_s:,.0f} mem {mem:.1f}GiB",
        flush=True,
    )
    return record


# ------------------------------------------------------------------------------------------- report


@torch.no_grad()
def heldout_loss(model, rows: torch.Tensor, device: str, batch: int) -> float:
    """Mean next-token cross-entropy over held-out rows, in float32."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch].to(device).long()
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        total += F.cross_entropy(
            logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
        ).item()
        count += chunk[:, 1:].numel()
    return total / max(count, 1)


def ends_in_loop(ids: list[int], window: int, max_period: int) -> bool:
    """True when the last `window` tokens repeat with some period p <= max_period
    (ids[i] == ids[i+p])."""
    if len(ids) < window:
        return False
    tail = ids[-window:]
    return any(
        all(tail[i] == tail[i + p] for i in range(window - p)) for p in range(1, max_period + 1)
    )


def repeats_lines(text: str, ended: bool, times: int = 3) -> bool:
    """True when the answer's last `times` complete lines are one non-blank line repeated: a loop
    whose period (a line, ~10-20 tokens) is too long for ends_in_loop, and as easy for a drafter to
    predict."""
    # an answer cut by the limit ends mid-line
    lines = text.split("\n") if ended else text.split("\n")[:-1]
    tail = [line for line in lines if line.strip()][-times:]
    return len(tail) == times and len(set(tail)) == 1


@torch.no_grad()
def greedy_answers(
    model, tokenizer, users: list[str], cfg: TargetConfig, device: str
) -> list[dict]:
    """Greedy answers (float32, left-padded batches) to the given user turns: ids, ended, loops."""
    model.eval()
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.pad_token_id
    results = []
    for start in range(0, len(users), GEN_BATCH):
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": u}], tokenize=False, add_generation_prompt=True
            )
            for u in users[start : start + GEN_BATCH]
        ]
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=cfg.max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        for row in out[:, width:].tolist():
            ended = eos in row
            answer = row[: row.index(eos)] if ended else row
            results.append(
                {
                    "ids": answer,
                    "ended": ended,
                    "loops": ends_in_loop(answer, cfg.loop_window, cfg.loop_max_period),
                    "repeats_lines": repeats_lines(tokenizer.decode(answer), ended),
                }
            )
    return results


def quality_report(model, tokenizer, heldout_rows, heldout_users, cfg, device) -> dict:
    """Held-out loss/perplexity and the greedy-answer figures, as written to report.json."""
    loss = heldout_loss(model, heldout_rows, device, batch=min(cfg.batch, 64))
    answers = greedy_answers(model, tokenizer, heldout_users[: cfg.report_prompts], cfg, device)
    n = max(len(answers), 1)
    return {
        "heldout_loss": loss,
        "heldout_ppl": math.exp(loss),
        "heldout_tokens": int(heldout_rows[:, 1:].numel()),
        "answers": len(answers),
        "loop_frac": sum(a["loops"] for a in answers) / n,
        "ended_frac": sum(a["ended"] for a in answers) / n,
        "line_repeat_frac": sum(a["repeats_lines"] for a in answers) / n,
        "mean_answer_tokens": sum(len(a["ids"]) for a in answers) / n,
        "loop_definition": f"last {cfg.loop_window} answer tokens repeat "
        f"with a period <= {cfg.loop_max_period}",
        "line_repeat_definition": "last 3 complete non-blank lines of the answer are the same line",
        "examples": [
            {"prompt": u[-300:], "answer": tokenizer.decode(a["ids"])}
            for u, a in zip(heldout_users, answers[:3])
        ],
    }


def print_report(report: dict, training: dict, params: int) -> None:
    rows = [
        ("parameters", f"{params / 1e6:.2f} M"),
        ("train steps", str(training["steps"])),
        ("train tokens/s", f"{training['tokens_per_s']:,.0f}"),
        ("final train loss", f"{training['final_loss']:.4f}"),
        ("held-out loss", f"{report['heldout_loss']:.4f}"),
        ("held-out perplexity", f"{report['heldout_ppl']:.2f}"),
        ("greedy answers that loop", f"{report['loop_frac']:.1%} of {report['answers']}"),
        ("greedy answers repeating a line 3 times", f"{report['line_repeat_frac']:.1%}"),
        ("greedy answers ending with <|im_end|>", f"{report['ended_frac']:.1%}"),
        ("mean answer tokens", f"{report['mean_answer_tokens']:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"| {'metric':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")
    for ex in report["examples"][:2]:
        print(f"\n--- prompt (tail) ---\n{ex['prompt']}\n--- greedy answer ---\n{ex['answer']}")


# ------------------------------------------------------------------------------------ output, cache


@torch.no_grad()
def round_to_bf16(model) -> None:
    """Round every weight to bf16 in place (kept in float32): the target is saved in bf16, as
    released checkpoints are (half the bytes to move between machines), and every later stage loads
    those exact values (upcast to float32 where it runs in float32), so the report is measured on
    them too."""
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).float())


def save_target(model, tokenizer, path: Path) -> None:
    """HF layout: model (bf16), tokenizer + chat template, greedy generation config ending at
    <|im_end|>."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # transformers 5 writes only rope_parameters; loaders on 4.x would then silently assume a
    # default theta
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = ROPE_THETA
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_prompts(path: Path, users: list[str]) -> None:
    """OpenAI `messages` JSONL, one user turn per line, for dflash-generate."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(
            json.dumps({"messages": [{"role": "user", "content": user}]}) + "\n" for user in users
        )


def cached(out: Path, settings: dict, force: bool) -> bool:
    """True when `out` already holds a target built with these settings; refuses to overwrite
    another."""
    manifest = out / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("settings") == settings:
        print(
            f"{out}: a target with these settings is already there (manifest.json matches); "
            "skipping"
        )
        return True
    if out.exists() and any(out.iterdir()) and not force:
        what = (
            "a target built with other settings"
            if manifest.is_file()
            else "files but no manifest.json"
        )
        raise SystemExit(
            f"{out} holds {what}; pass --force to rebuild it there, or choose another --out"
        )
    return False


def publish(partial: Path, out: Path) -> None:
    """Replace `out` by the finished build in one rename (nothing half-written is ever at `out`)."""
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)


def versions() -> dict:
    import tokenizers
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
    }


@contextlib.contextmanager
def timed(name: str, timings: dict):
    start = time.perf_counter()
    print(f"[{name}] ...", flush=True)
    yield
    timings[name] = round(time.perf_counter() - start, 3)
    print(f"[{name}] {timings[name]:.1f} s", flush=True)


# ---------------------------------------------------------------------------------------------- run


def prepare_data(cfg: TargetConfig, timings: dict) -> dict:
    """Corpus -> tokenizer -> shuffled, tokenized train/held-out rows, and the prompts of both
    splits."""
    with timed("corpus", timings):
        files, corpus = select_corpus(cfg)
        spans = all_function_spans(files, cfg.workers)
        splits = split_documents(files, function_pairs(files, spans, cfg), cfg)
    with timed("bpe", timings):
        tok = train_bpe(files, cfg)
    with timed("encode", timings):
        train_stream = encode_stream(tok, splits["train"]["docs"], cfg.seed)
        heldout_stream = encode_stream(tok, splits["heldout"]["docs"], cfg.seed)
    n_text = sum(len(d) for s in splits.values() for d in s["docs"])
    print(
        f"corpus: {len(files)} files, {corpus['bytes'] / 1e6:.1f} MB; "
        f"{n_text / 1e6:.1f} MB of documents -> "
        f"{len(train_stream) + len(heldout_stream):,} tokens "
        f"({n_text / max(timings['encode'], 1e-9) / 1e6:.1f} MB/s)"
    )
    record, corpus["files_sha256"] = corpus_record(files)
    mask_id = tok.token_to_id(MASK)
    corpus.update(
        train_files=sum(not f.heldout for f in files),
        heldout_files=sum(f.heldout for f in files),
        train_tokens=len(train_stream),
        heldout_tokens=len(heldout_stream),
        chat_samples={k: v["chat_samples"] for k, v in splits.items()},
        documents={k: len(v["docs"]) for k, v in splits.items()},
        mask_tokens_in_training_data=int(np.count_nonzero(train_stream == mask_id)),
    )
    assert corpus["mask_tokens_in_training_data"] == 0, "the MASK token must never be trained on"
    return {
        "tokenizer": wrap_tokenizer(tok),
        "corpus": corpus,
        "files_record": record,
        "train_rows": to_rows(train_stream, cfg.seq_len),
        "heldout_rows": to_rows(heldout_stream, cfg.seq_len)[: cfg.eval_rows],
        "prompts": {k: v["prompts"] for k, v in splits.items()},
    }


def write_outputs(partial: Path, model, data: dict, manifest: dict, report: dict) -> None:
    save_target(model, data["tokenizer"], partial)
    write_prompts(partial / "prompts" / "train.jsonl", data["prompts"]["train"])
    write_prompts(partial / "prompts" / "heldout.jsonl", data["prompts"]["heldout"])
    with open(partial / "corpus_files.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in data["files_record"])
    (partial / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    # last: it marks completion
    (partial / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def run(cfg: TargetConfig) -> Path:
    """Build the target into cfg.out (or reuse it there); returns the directory."""
    device = (
        ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    )
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible here; use --device cpu")
    out, settings, timings = Path(cfg.out), cfg.settings(device), {}
    if cached(out, settings, cfg.force):
        return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a previous build that died: ours by its name
    partial.mkdir(parents=True)
    t0 = time.perf_counter()
    data = prepare_data(cfg, timings)
    model = build_model(cfg).to(device)
    params = sum(p.numel() for p in model.parameters())  # tied: the embedding is counted once
    print(
        f"model: {params / 1e6:.2f} M parameters; "
        f"{len(data['train_rows']):,} training rows of {cfg.seq_len}"
    )
    with timed("train", timings):
        training = train(model, data["train_rows"], cfg, device, partial / "train_log.jsonl")
    # the target *is* its bf16 weights from here on: report, save, every later stage
    round_to_bf16(model)
    with timed("report", timings):
        report = quality_report(
            model, data["tokenizer"], data["heldout_rows"], data["prompts"]["heldout"], cfg, device
        )
    report.update(training=training, parameters=params)
    print_report(report, training, params)
    timings["total"] = round(time.perf_counter() - t0, 3)
    tok = data["tokenizer"]
    manifest = {
        "settings": settings,
        "versions": versions(),
        "parameters": params,
        "timings_s": timings,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "token_ids": {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS},
        "corpus": data["corpus"],
        "training": training,
        "heldout_loss": report["heldout_loss"],
        "heldout_ppl": report["heldout_ppl"],
        "prompts": {
            "train": "prompts/train.jsonl",
            "heldout": "prompts/heldout.jsonl",
            "train_count": len(data["prompts"]["train"]),
            "heldout_count": len(data["prompts"]["heldout"]),
        },
    }
    write_outputs(partial, model.cpu().to(torch.bfloat16), data, manifest, report)
    publish(partial, out)
    print(f"wrote {out}")
    return out


def parse_args(argv: list[str] | None = None) -> TargetConfig:
    """The CLI is the dataclass: one --flag per field, its help from the field's metadata."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    hints = typing.get_type_hints(TargetConfig)
    for field in dataclasses.fields(TargetConfig):
        flag, kind = "--" + field.name.replace("_", "-"), hints[field.name]
        if kind is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=field.metadata["help"],
            )
            continue
        kind = (
            next(a for a in typing.get_args(kind) if a is not type(None))
            if typing.get_args(kind)
            else kind
        )
        required = field.name == "out"
        parser.add_argument(
            flag,
            type=kind,
            default=argparse.SUPPRESS if required else field.default,
            help=field.metadata["help"],
            required=required,
        )
    try:
        return TargetConfig(**vars(parser.parse_args(argv)))
    except ValueError as err:
        parser.error(str(err))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    run(cfg)


if __name__ == "__main__":
    main()
