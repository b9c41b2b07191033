"""The embedded tiny target: a real Qwen3-architecture causal LM and tokenizer built from a config
with a fixed seed and saved to disk, so tests and `make demo` run the whole product with no
download.

The tokenizer is byte-level (every UTF-8 byte is a token) with Qwen-style chat special tokens and a
chat template. By default the template carries `{% generation %}` markers, so transformers can
return the assistant-token mask; `generation_markers=False` gives a template without them, which
exercises the fallback that finds assistant spans by rendering (see dflash_common/chat.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

# Chat tokens as in Qwen3; the mask token is added to the vocabulary, as DFlash does (151669 on
# Qwen3).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
MASK_TOKEN = "<|mask|>"
NUM_BYTE_TOKENS = 256

_TEMPLATE_MARKED = (
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
_TEMPLATE_PLAIN = _TEMPLATE_MARKED.replace("{% generation %}", "").replace(
    "{% endgeneration %}", ""
)


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny target. 8 layers make the DFlash default layer ids [1, 2, 3, 4, 5]
    distinct."""

    num_layers: int = 8
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 320  # 256 bytes + 4 special tokens, padded (unused rows, like Qwen3's)
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # wider than HF's 0.02: greedy text mixes structure and variety, not one repeated token
    initializer_range: float = 0.1
    generation_markers: bool = True
    seed: int = 0

    def fingerprint(self) -> str:
        return hashlib.sha256(
            json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        ).hexdigest()[:16]


def build_tiny_tokenizer(generation_markers: bool = True):
    """A byte-level fast tokenizer with Qwen-style chat tokens, built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    assert len(vocab) == NUM_BYTE_TOKENS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", MASK_TOKEN],
    )
    fast.chat_template = _TEMPLATE_MARKED if generation_markers else _TEMPLATE_PLAIN
    return fast


def build_tiny_target(path: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write the tiny target (config.json, model.safetensors, tokenizer) to `path`; idempotent.

    A directory already holding this exact spec is reused, so a session-scoped test fixture and
    `make demo` pay the construction once.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    stamp = path / "tiny_spec.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == spec.fingerprint():
        return path
    tokenizer = build_tiny_tokenizer(spec.generation_markers)
    assert len(tokenizer) <= spec.vocab_size
    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).eval()
    path.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard save: its bar would be two frames of noise
    try:
        model.save_pretrained(path)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(path)
    stamp.write_text(
        json.dumps({"fingerprint": spec.fingerprint(), "spec": dataclasses.asdict(spec)})
    )
    return path


def main(argv: list[str] | None = None) -> None:
    """`python -m dflash_common.tiny OUT_DIR`: build the default tiny target (what `make demo` and
    configs/tiny.toml use, in .cache/tiny-target)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m dflash_common.tiny",
        description="Build the embedded tiny target (TinySpec defaults) into OUT_DIR.",
    )
    parser.add_argument(
        "out_dir", help="directory to write the target to (reused if it already holds it)"
    )
    args = parser.parse_args(argv)
    print(build_tiny_target(args.out_dir, TinySpec()))


if __name__ == "__main__":
    main()
