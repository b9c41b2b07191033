"""The target, its tokenizer and the drafter of a `dflash-eval` run, loaded on their device and
checked against each other: a drafter made for another target is refused in one sentence.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_common.errors import UserError
from train.eval.spec_decode import DFlashProposer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"target.device = {name!r} but no CUDA GPU is visible; use 'auto' or 'cpu'.")
    return device


def load_target(path: str, dtype: str, device: str, attn_implementation: str):
    """The target causal LM, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    return model.to(resolve_device(device)).eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    check_model_dir(path)
    return AutoTokenizer.from_pretrained(path)


def check_model_dir(path: str) -> None:
    if not path or not (Path(path) / "config.json").is_file():
        raise UserError(f"target.path {path!r} is not a model directory (no config.json); set --target.path=DIR.")


def load_dflash(path: str, target_config, device: torch.device, dtype: torch.dtype):
    """The exported drafter at `path`, refused in one sentence unless it was made for this target."""
    from dflash_common.drafter.export import load_drafter

    if not path:
        raise UserError("no drafter: pass --drafter DIR (an exported drafter, a step-N checkpoint or a run directory).")
    drafter, dcfg = load_drafter(path, device=device, dtype=dtype)
    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    wants = {"hidden_size": t.hidden_size, "vocab_size": t.vocab_size, "num_target_layers": t.num_hidden_layers}
    bad = [f"{k} {getattr(dcfg, k)} vs the target's {v}" for k, v in wants.items() if getattr(dcfg, k) != v]
    if bad:
        raise UserError(
            f"drafter {path} was made for another target ({'; '.join(bad)}); evaluate it on its own target.")
    return drafter.eval()


def attach_target(drafter, model, block_size: int | None = None,
                  confidence_threshold: float = 0.0) -> DFlashProposer:
    """The drafter behind the engine's protocol, with the loaded target's embedding and lm_head
    attached (shared, not read again)."""
    drafter.attach_frozen(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    if confidence_threshold > 0 and getattr(drafter, "confidence_head", None) is None:
        raise UserError("generation.confidence_threshold needs a DSpark drafter with a confidence "
                        "head; set it to 0.")
    return DFlashProposer(drafter, block_size, confidence_threshold)


def load_proposer(path: str, model) -> DFlashProposer:
    """The exported drafter at `path` on the target's device and dtype, ready to propose."""
    weight = next(model.parameters())
    return attach_target(load_dflash(path, model.config, weight.device, weight.dtype), model)


def stop_token_ids(model, tokenizer) -> frozenset[int]:
    """End-of-sequence ids of the generation config and the tokenizer (Qwen3 chat ends at <|im_end|>)."""
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return frozenset(ids)
