"""Fingerprints that tie a store to what made it: the target, the tokenizer and chat template, the data.

They go into the store's manifest, so a store is never silently mixed with states of another model,
tokenizer or dataset. All are computed from content (never paths, sizes of unrelated files, or times),
so every rank of a run, and a rerun on another machine, computes the same values.

- target: sha256 of config.json, and `weights_sha256` over each weight file's name, size, header
  (safetensors) and 16 evenly spaced 64 KiB blocks of its bytes. Headers alone would not tell a
  fine-tune from its base (same names, shapes, offsets); sampled blocks do, at ~1 MiB of reads per
  file instead of hashing hundreds of GB.
- target head: what a drafter takes from its target, exactly: sha256 of the embedding and lm_head
  tensors the trainer loads (dtype, shape, every byte) and the config fields the drafter copies
  (sizes, vocabulary, RoPE, norm epsilon). The trainer compares them with its `run.target`.
- tokenizer: sha256 of the vocabulary (token -> id, added tokens included) and the special tokens.
- chat template: sha256 of the template text.
- dataset: sha256 of each input file's bytes (whole files: datasets are GBs, hashing runs at ~1 GB/s).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_common.hf import check_model_dir, read_config_json, text_fields

SAMPLE_BLOCKS = 16  # blocks hashed per weight file: enough to catch any fine-tune, ~1 MiB of reads
SAMPLE_BLOCK_BYTES = 64 * 1024
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _weight_files(model_dir: Path) -> list[Path]:
    for pattern in _WEIGHT_PATTERNS:  # safetensors first: a directory may carry both formats
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    return []


def _hash_weight_file(h: Any, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            (header_len,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(min(header_len, size - 8)))
        for k in range(SAMPLE_BLOCKS):
            f.seek(max(0, (size - SAMPLE_BLOCK_BYTES) * k // max(1, SAMPLE_BLOCKS - 1)))
            h.update(f.read(SAMPLE_BLOCK_BYTES))


def weights_sha256(model_dir: str | Path) -> str | None:
    """Hash of a checkpoint's weight files (names, sizes, safetensors headers, sampled blocks)."""
    files = _weight_files(Path(model_dir))
    if not files:
        return None
    h = hashlib.sha256()
    for path in files:
        _hash_weight_file(h, path)
    return h.hexdigest()


def target_fingerprint(model_dir: str | Path, name: str | None = None) -> dict[str, Any]:
    """What identifies a target checkpoint directory (config.json + weight files)."""
    model_dir = check_model_dir(model_dir, "target")
    raw = (model_dir / "config.json").read_bytes()  # hashed as stored
    text = text_fields(json.loads(raw))
    return {
        "name": name if name is not None else model_dir.name,
        "config_sha256": hashlib.sha256(raw).hexdigest(),
        "weights_sha256": weights_sha256(model_dir),
        "num_layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
    }


# The target's config fields a DFlash drafter copies (DrafterConfig.from_target) or depends on.
DRAFTER_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "rope_scaling",
                       "rope_parameters", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")


def head_fingerprint(model_dir: str | Path) -> dict[str, Any]:
    """{"head_sha256", "config"}: the embedding and lm_head a drafter is trained and served with,
    hashed as stored, and the config fields it copies. Content only: any directory name, any file
    split (sharded or not) of the same tensors gives the same value."""
    import torch

    from dflash_common.drafter.target_head import load_target_head

    text = text_fields(read_config_json(model_dir, "target"))
    head = load_target_head(model_dir)  # as stored: no cast
    h = hashlib.sha256()
    for name, tensor in [("embed", head.embed)] + ([] if head.tied else [("lm_head", head.lm_head)]):
        h.update(f"{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        h.update(memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()))  # no copy
    return {"head_sha256": h.hexdigest(), "config": {k: text.get(k) for k in DRAFTER_CONFIG_KEYS}}


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """sha256 of a (transformers) tokenizer's vocabulary and special tokens, and its size."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {"map": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
               "all": sorted(tokenizer.all_special_tokens)}
    return {"sha256": _sha256_json({"vocab": vocab, "special": special}), "vocab_size": len(tokenizer)}


def chat_template_sha256(template: Any) -> str | None:
    """sha256 of a chat template (a tokenizer's `chat_template`, or the template text); None if none."""
    text = getattr(template, "chat_template", template)
    if text is None:
        return None
    data = text if isinstance(text, str) else json.dumps(text, sort_keys=True)  # named templates: a dict
    return hashlib.sha256(data.encode()).hexdigest()


def file_sha256(path: str | Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _dataset_files(path: Path) -> list[tuple[str, Path]]:
    """(name inside the dataset, file) for a file, or every file under a directory (e.g. saved
    `datasets` arrow files), hidden files excluded."""
    if path.is_file():
        return [(path.name, path)]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if not f.startswith("."):
                full = Path(dirpath) / f
                out.append((str(full.relative_to(path.parent)), full))
    return out


def dataset_fingerprint(paths: Sequence[str | Path], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Content hash of the input data: every file's name (relative to its input), size and sha256,
    plus `extra` (e.g. the data-reading options that change what is read)."""
    files = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise FileNotFoundError(f"dataset input {p} does not exist")
        for name, full in _dataset_files(p):
            files.append({"name": name, "bytes": full.stat().st_size, "sha256": file_sha256(full)})
    out: dict[str, Any] = {"files": files, "sha256": _sha256_json(files)}
    if extra:
        out["extra"] = json.loads(json.dumps(extra, sort_keys=True))
    return out
