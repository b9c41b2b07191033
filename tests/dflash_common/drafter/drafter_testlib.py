"""Small drafters and packed batches shared by the drafter's tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_common.drafter.arch import config_class, new_drafter
from dflash_common.drafter.config import DrafterConfig
from dflash_common.drafter.model import DFlashDrafter

ANCHORS = [0, 3, 6, 7, 11, 12, 18, 27]  # seq 0 = [0, 11), seq 1 = [11, 31); includes both starts
TINY_MASK_ID = 259  # <|mask|> of the tiny tokenizer (256 bytes + 3 chat tokens before it)


def tiny_config(target_dir: Path, arch: str = "dflash", **overrides) -> DrafterConfig:
    """A 2-layer drafter over the tiny target, its first layer sliding with a window short enough
    to matter on 20-token sequences; `arch`'s own fields among `overrides`."""
    options = dict(
        mask_token_id=TINY_MASK_ID,
        depth=2,
        block_size=4,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=5,
    )
    options.update(overrides)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    return config_class(arch).from_target(target, **options)


def tiny_drafter(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """Random weights, norms perturbed away from 1 so a norm applied twice or skipped shows."""
    torch.manual_seed(seed)
    drafter = new_drafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(5.0)  # a larger init: attention patterns far from uniform, so masks matter
    g = torch.Generator().manual_seed(seed + 1)
    v, h = cfg.vocab_size, cfg.hidden_size
    drafter.attach_frozen(torch.randn(v, h, generator=g), torch.randn(v, h, generator=g))
    return drafter


def packed_batch(cfg: DrafterConfig, lengths=(11, 20), seed: int = 0):
    """(context [T, K*H], input_ids [T], cu_seqlens [N+1]) of random features and tokens."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    context = torch.randn(total, cfg.num_context_layers * cfg.hidden_size, generator=g)
    input_ids = torch.randint(0, 256, (total,), generator=g)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return context, input_ids, cu_seqlens


@torch.no_grad()
def randomise_dflash2(drafter, seed: int = 0):
    """Move a DFlash2 drafter's convolutions and selector off their start (identity, zero successor
    codebook), far enough that a wrong tap, group, side or predecessor shows."""
    g = torch.Generator().manual_seed(seed)
    for name, p in drafter.named_parameters():
        if "_conv." in name or name.startswith("candidate_selector."):
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "_conv." in name else 1.0))
    return drafter
