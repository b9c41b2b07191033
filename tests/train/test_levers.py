"""The training levers of issue 17 on real batches of the tiny store, each against its objective
computed another way: D-PACE weights and anchor normalisation against plain F.cross_entropy on
materialised [N, V] logits (also over two accumulated micro-batches), feature noise (seeded, off in
validation) and the weights' EMA against an explicit running average. Resume with them all on is in
test_loop.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from grad_helpers import accumulate, setup

import train.loop as loop
from dflash_common.drafter.objective import IGNORE_INDEX, block_labels, dpace_weights
from train.regularise import WeightAverage, add_feature_noise, noise_generator
from train.validate import batch_objective


@pytest.fixture(scope="module")
def two_batches(tiny_store, tiny_target, one_thread):
    return setup(tiny_store, tiny_target, grad_accum=2)


def _with(cfg, **objective):
    return dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, **objective))


def _explicit_parts(drafter, batch, weights: str, alpha: float = 0.5):
    """(sum of w * CE, weight sum, valid blocks) with the logits materialised and F.cross_entropy."""
    labels, gamma_w = block_labels(batch.input_ids, batch.loss_mask, batch.cu_seqlens, batch.anchors,
                                   drafter.cfg.block_size)
    hidden = drafter(batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors)  # [A, B, H]
    logits = hidden.float() @ drafter.lm_head_weight.float().T  # [A, B, V]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none",
                         ignore_index=IGNORE_INDEX).view_as(labels)
    valid = labels != IGNORE_INDEX
    w = dpace_weights(ce.detach(), valid, alpha) if weights == "dpace" else gamma_w
    return (w * ce).sum(), w.sum(), valid[:, 1:].any(1).sum().float()


def _grads(drafter, loss):
    drafter.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)  # some tests take two normalisations of one forward
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-7) for k in a)


@pytest.mark.parametrize("normalise", ["weight", "anchors"])
def test_dpace_loss_and_gradient_equal_the_explicit_objective(two_batches, normalise):
    _, drafter, (batch, _) = two_batches
    loss, norm, _ = batch_objective(drafter, drafter, batch, block_size=drafter.cfg.block_size, gamma=None,
                                    autocast="none", weights="dpace", dpace_alpha=0.3, normalise=normalise)
    got = _grads(drafter, loss / norm)
    ce_sum, w_sum, blocks = _explicit_parts(drafter, batch, "dpace", alpha=0.3)
    want_norm = blocks if normalise == "anchors" else w_sum
    torch.testing.assert_close(loss, ce_sum, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(norm, want_norm)
    assert _close(got, _grads(drafter, ce_sum / want_norm))
    gamma_loss = batch_objective(drafter, drafter, batch, block_size=drafter.cfg.block_size, gamma=None,
                                 autocast="none")[0]
    assert not torch.allclose(gamma_loss, loss, rtol=0.05)  # the lever changes the objective


@pytest.mark.parametrize("weights", ["gamma", "dpace"])
def test_normalise_anchors_over_two_micro_batches_divides_by_all_their_blocks(two_batches, weights):
    cfg, drafter, batches = two_batches
    cfg = _with(cfg, normalise="anchors", weights=weights)
    parts = [_explicit_parts(drafter, b, weights) for b in batches]
    assert parts[0][2] != parts[1][2]  # the two batches hold different numbers of blocks
    want = _grads(drafter, sum(p[0] for p in parts) / sum(p[2] for p in parts))
    assert _close(accumulate(drafter, drafter, cfg, batches), want)
    by_weight = _grads(drafter, sum(p[0] for p in parts) / sum(p[1] for p in parts))
    assert not _close(want, by_weight)


def test_feature_noise_is_seeded_per_batch_and_relative_to_each_layers_rms():
    torch.manual_seed(0)
    features = torch.cat([torch.randn(4000, 32) * 0.01, torch.randn(4000, 32) * 100.0], dim=1)  # K=2, H=32
    a, b, c = features.clone(), features.clone(), features.clone()
    add_feature_noise(a, 32, 0.1, noise_generator(a.device, 7, 1, 0, 5))
    add_feature_noise(b, 32, 0.1, noise_generator(b.device, 7, 1, 0, 5))
    add_feature_noise(c, 32, 0.1, noise_generator(c.device, 7, 1, 0, 6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    for k in range(2):
        cols = slice(32 * k, 32 * (k + 1))
        rms = features[:, cols].pow(2).mean(-1, keepdim=True).sqrt()
        ratio = ((a - features)[:, cols] / rms).std()
        assert ratio == pytest.approx(0.1, rel=0.03)


def test_noise_changes_training_steps_but_never_validation(tiny_store, tiny_target, tmp_path, one_thread):
    from test_loop import _args, _cfg

    figures = {}
    for noise in (0.0, 0.5):
        r = loop.setup(_cfg(*_args(tiny_store, tiny_target, tmp_path / f"n{noise}", "--optim.max_steps=1",
                                   "--run.device=cpu", f"--regularise.noise={noise}")))
        try:
            val = loop.validate(r, 0, None)
            sums = torch.zeros(loop._N + 1, dtype=torch.float64)
            counts = torch.zeros(2 * r.drafter.cfg.block_size + 2, dtype=torch.float64)
            loop.accumulate_gradients(r.model, r.drafter, r.data.start(), r.cfg, sums, counts)
            figures[noise] = (val, float(sums[loop._LOSS]))
        finally:
            r.data.close()
    assert figures[0.0][0] == figures[0.5][0]  # validation: no noise
    assert figures[0.0][1] != pytest.approx(figures[0.5][1], rel=1e-4)  # training: noise


def test_ema_equals_the_running_average_written_out(two_batches):
    cfg, drafter, batches = two_batches
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, grad_accum=1))
    optimizer, scheduler = loop.build_optimizer(cfg, drafter, total=10, device=torch.device("cpu"))
    start = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    ema = WeightAverage(drafter, 0.8)
    want = dict(start)
    sums = torch.zeros(loop._N + 1, dtype=torch.float64)
    counts = torch.zeros(2 * drafter.cfg.block_size + 2, dtype=torch.float64)
    for step in range(3):
        loop.train_step(drafter, drafter, iter(batches[step % 2:step % 2 + 1]), optimizer, scheduler, cfg,
                        sums, counts, ema)
        want = {n: 0.8 * want[n] + 0.2 * p.detach() for n, p in drafter.named_parameters()}
    trained = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    state = ema.state_dict()
    assert all(torch.allclose(state[n], want[n], rtol=1e-6, atol=1e-7) for n in want)
    with ema.swapped_in():
        assert all(torch.equal(p, state[n]) for n, p in drafter.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in drafter.named_parameters())  # trained weights back
    assert not all(torch.allclose(trained[n], want[n]) for n in want)
    with torch.no_grad():  # leave the module fixture as it was
        for n, p in drafter.named_parameters():
            p.copy_(start[n])


def test_resuming_with_or_without_an_average_the_checkpoint_lacks_or_holds(two_batches, tmp_path):
    _, drafter, _ = two_batches
    start = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    trained = {n: t + 1.0 for n, t in start.items()}  # as a checkpoint's trainer.pt holds them
    ema = WeightAverage(drafter, 0.9)
    loop._resume_average(tmp_path, trained, drafter, ema)  # drafter/ (the average) was just loaded
    assert all(torch.equal(s, start[n]) for n, s in ema.state_dict().items())
    assert all(torch.equal(p, trained[n]) for n, p in drafter.named_parameters())
    loop._resume_average(tmp_path, None, drafter, ema)  # written without an EMA: it starts from the weights
    assert all(torch.equal(s, trained[n]) for n, s in ema.state_dict().items())
    loop._resume_average(tmp_path, start, drafter, None)  # the EMA turned off: train on the trained weights
    assert all(torch.equal(p, start[n]) for n, p in drafter.named_parameters())
