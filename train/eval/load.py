"""The drafter of a `dflash-eval` run, loaded on the target's device and checked against it: a
drafter made for another target is refused in one sentence. (The target and its tokenizer load
through dflash_common/hf.py, as every stage's do.)
"""

from __future__ import annotations

import torch

from dflash_common.errors import UserError
from train.eval.spec_decode import DFlashProposer

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
