"""The target's token embedding and lm_head, read straight from its safetensors.

Only these one or two tensors are read (safetensors maps the file and copies just their bytes), so
a 27B target costs its 2 x [V, H] and nothing else. Works with a single `model.safetensors` or a
sharded checkpoint (`model.safetensors.index.json`), and with tied embeddings (no lm_head tensor:
the embedding is returned for both, the same tensor object).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_common.errors import UserError
from dflash_common.hf import read_config_json, text_fields

# Where causal LMs keep the input embedding, most common first (plain, multimodal, GPT-2 style).
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.embed_tokens.embedding.weight",
    "transformer.wte.weight",
    "embed_tokens.weight",
)
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


@dataclass(frozen=True)
class TargetHead:
    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]; the same object as `embed` when the target ties them
    tied: bool


def load_target_head(
    target_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> TargetHead:
    """Read the target's embedding and lm_head ([V, H] each) from `target_dir`'s safetensors."""
    target_dir = Path(target_dir)
    config = read_config_json(target_dir, "target")
    text = text_fields(config)
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    where = _tensor_files(target_dir)
    embed_name = _first_present(EMBED_NAMES, where)
    if embed_name is None:
        raise UserError(f"no token embedding found in {target_dir} (looked for {', '.join(EMBED_NAMES)}).")
    head_name = _first_present(LM_HEAD_NAMES, where)
    if head_name is None and not tied:
        raise UserError(
            f"{target_dir} has no lm_head tensor ({', '.join(LM_HEAD_NAMES)}) and its config does not set "
            f"tie_word_embeddings; the checkpoint is incomplete."
        )
    embed = _read(where, embed_name, device, dtype)
    lm_head = embed if head_name is None else _read(where, head_name, device, dtype)
    if embed.shape != lm_head.shape:
        raise UserError(f"{target_dir}: embedding {tuple(embed.shape)} and lm_head {tuple(lm_head.shape)} differ.")
    return TargetHead(embed=embed, lm_head=lm_head, tied=head_name is None)


def _tensor_files(target_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    single = target_dir / "model.safetensors"
    if not single.is_file():
        raise UserError(
            f"{target_dir} has neither model.safetensors nor model.safetensors.index.json; "
            f"save the target with safetensors (save_pretrained does by default)."
        )
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _first_present(names: tuple[str, ...], where: dict[str, Path]) -> str | None:
    return next((name for name in names if name in where), None)


def _read(where: dict[str, Path], name: str, device, dtype) -> torch.Tensor:
    path = where[name]
    if not path.is_file():
        raise UserError(f"{path} (holding {name}) is missing; the target checkpoint is incomplete.")
    with safe_open(path, framework="pt", device=str(device)) as f:
        tensor = f.get_tensor(name)
    return tensor if dtype is None else tensor.to(dtype)
