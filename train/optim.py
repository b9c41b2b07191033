"""The optimiser and its learning-rate schedule.

`optim.name = "adamw"` is the DFlash recipe: AdamW over every trainable weight. `"muon"` is the
optimiser the field now recommends for drafters: Muon (torch.optim.Muon: momentum, then the update
orthogonalised by Newton-Schulz iterations) for the weight matrices of linear layers, AdamW for the
rest (norm scales; embedding-like tables such as a Markov head's, which Muon's authors leave to AdamW
as they do embeddings and heads). Muon's update is scaled to AdamW's RMS (`adjust_lr_fn =
"match_rms_adamw"`, Moonshot's rule), so both take the same `optim.lr` and the same schedule.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from train.config import OptimSection


def lr_factor(step: int, total: int, warmup_fraction: float, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr after `step` optimiser steps: linear warmup, then cosine (or flat)."""
    warmup = math.ceil(warmup_fraction * total)
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class MuonAdamW(torch.optim.Optimizer):
    """Muon for `matrices`, AdamW for `others`, stepped as one optimiser.

    The two inner optimisers own the parameter groups; this one lists the same group dicts, so a
    learning-rate scheduler that sets `group["lr"]` here sets it for both."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        super().__init__([*muon.param_groups, *adamw.param_groups], {})
        # Optimizer.__init__ keeps the group dicts it is given: they are the inner optimisers' own
        assert all(a is b for a, b in zip(self.param_groups, [*muon.param_groups, *adamw.param_groups]))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("MuonAdamW takes no closure")
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # loading gives the inner optimisers new group dicts: list those, or the scheduler would set
        # the learning rate of groups no optimiser steps any more
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]


def muon_matrices(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(weights Muon orthogonalises, the others): the trainable weight matrices of `nn.Linear`
    layers with both sides > 1 (a [1, H] row, such as a confidence head's, has no orthogonal
    direction to take), and everything else."""
    matrices = {id(m.weight) for m in model.modules()
                if isinstance(m, nn.Linear) and m.weight.requires_grad and min(m.weight.shape) > 1}
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if id(p) in matrices], [p for p in params if id(p) not in matrices]


def build_optimizer(o: OptimSection, model: nn.Module, total: int, device: torch.device):
    """(optimiser, LambdaLR scheduler) for the trainable parameters of `model` over `total` steps."""
    fused = device.type == "cuda"
    if o.name == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=o.lr, betas=tuple(o.betas), eps=o.eps,
            weight_decay=o.weight_decay, fused=fused)
    else:
        matrices, others = muon_matrices(model)
        muon = torch.optim.Muon(matrices, lr=o.lr, weight_decay=o.weight_decay, momentum=o.muon_momentum,
                                adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW(others, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=fused)
        optimizer = MuonAdamW(muon, adamw)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, o.warmup_fraction, o.schedule, o.min_lr_ratio))
    return optimizer, scheduler
