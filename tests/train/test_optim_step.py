"""train.loop.clip_and_step: scaling, clipping and the AdamW step with the gradients read twice give
what scaling the gradients, clip_grad_norm_ and a plain AdamW step give, fused AdamW (its
grad_scale) and the unfused one alike."""

from __future__ import annotations

import math

import pytest
import torch

from train.loop import clip_and_step

# eps = 1: the update depends on the gradients' size (Adam's m / sqrt(v) alone hardly does), so a
# step that left the scale or the clip out could not pass
HYPER = dict(lr=0.1, betas=(0.9, 0.99), eps=1.0, weight_decay=0.01)


def _params(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(37, 11, generator=g).to(device).requires_grad_(),
        torch.randn(5, generator=g).to(device).requires_grad_(),
    ]


def _grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [3.0 * torch.randn(p.shape, generator=g).to(p.device) for p in params]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("max_norm", [0.5, math.inf], ids=["clipped", "unclipped"])
def test_clip_and_step_equals_scale_then_clip_grad_norm_then_step(device, fused, max_norm):
    ours, ref = _params(device), _params(device)
    opt = torch.optim.AdamW(ours, fused=fused, foreach=None if fused else True, **HYPER)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HYPER)
    scale = torch.tensor(
        0.25, dtype=torch.float64, device=device
    )  # the trainer's normaliser is float64
    for step in range(3):
        for p, r, grad in zip(ours, ref, _grads(step, ours)):
            p.grad, r.grad = grad.clone(), grad.clone() * 0.25
        norm = clip_and_step(opt, ours, max_norm, scale)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        ref_opt.step()
        assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
        if max_norm < math.inf:
            assert float(ref_norm) > max_norm  # the case clips
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"], rtol=1e-5, atol=1e-7
        )
    assert not hasattr(
        opt, "grad_scale"
    )  # nothing left on the optimiser for its next step or a checkpoint
