"""Regularisers for small data ([regularise] of train/config.py): Gaussian noise on the context
features while training, and an exponential moving average (EMA) of the weights.

- Noise: each token's features of each target layer get noise of standard deviation
  `scale * RMS(that layer's vector)` (layers differ in scale by orders of magnitude, so one absolute
  std would drown the early ones and miss the late ones). The generator is seeded by (seed, epoch,
  rank, batch index), like the anchors, so a resumed run draws the same noise without carrying
  state.
- EMA: shadow = decay * shadow + (1 - decay) * weights after every optimiser step, starting from the
  initial weights (no bias correction: with decay 0.999 the first ~1000 steps lean on the random
  start, which is what a cosine warmup is spent on anyway). Validation and the final drafter use the
  shadow (`swapped_in`); a checkpoint's drafter/ holds the shadow (what validation measured, what
  dflash-export and dflash-eval read) and its trainer.pt the trained weights, to resume from.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from train.plan import rng

_NOISE = 13  # random-stream tag (train/data.py uses 11-12, train/plan.py 1-3)


def noise_generator(
    device: torch.device, seed: int, epoch: int, rank: int, index: int
) -> torch.Generator:
    """The generator of one batch's feature noise, on the features' device."""
    return torch.Generator(device=device).manual_seed(
        int(rng(seed, _NOISE, epoch, rank, index).integers(0, 2**63 - 1))
    )


@torch.no_grad()
def add_feature_noise(
    features: torch.Tensor, hidden_size: int, scale: float, generator: torch.Generator
) -> None:
    """features [T, K*H] += N(0, (scale * RMS_k)^2) per token and layer k, in place (one [T, H]
    temporary at a time, not a [T, K*H] one)."""
    for k in range(features.shape[1] // hidden_size):
        layer = features[:, k * hidden_size : (k + 1) * hidden_size]  # [T, H] view
        rms = layer.float().pow(2).mean(-1, keepdim=True).sqrt()  # [T, 1]
        noise = torch.randn(
            layer.shape, generator=generator, device=layer.device, dtype=torch.float32
        )
        layer.add_((noise.mul_(rms * scale)).to(layer.dtype))


class WeightAverage:
    """An EMA of a module's parameters (float32 shadows of the same shapes)."""

    def __init__(self, module: torch.nn.Module, decay: float):
        self.decay = decay
        self.names = [n for n, _ in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """shadow += (1 - decay) * (weights - shadow): one fused op over all tensors."""
        torch._foreach_lerp_(
            self.shadow, [p.detach().float() for p in self.params], 1.0 - self.decay
        )

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The module holds the averaged weights inside the block, its trained ones again after."""
        with torch.no_grad():
            trained = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, t in zip(self.params, trained):
                    p.copy_(t)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: s.cpu() for n, s in zip(self.names, self.shadow)}
