"""The training levers of issue 17 on real batches of the tiny store, each against its objective
computed another way: D-PACE weights and anchor normalisation against plain F.cross_entropy on
materialised [N, V] logits (also over two accumulated micro-batches), the serving-path weights
against a plain loop over the positions and the explicit objective, feature noise (seeded, off in
validation) and the weights' EMA against an explicit running average. Resume with them all on is in
test_loop.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from grad_helpers import accumulate, setup

import train.loop as loop
from dflash_common.dist import start_ranks
from dflash_common.drafter.loss import fused_lm_head_loss
from dflash_common.drafter.objective import (
    IGNORE_INDEX,
    block_labels,
    dpace_weights,
    sample_anchors,
    serving_path,
)
from train.objective import batch_objective
from train.optim import build_optimizer
from train.regularise import WeightAverage, add_feature_noise, noise_generator


@pytest.fixture(scope="module")
def two_batches(tiny_store, tiny_target, one_thread):
    return setup(tiny_store, tiny_target, grad_accum=2)


def _with(cfg, **objective):
    return dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, **objective))


def _explicit_parts(drafter, batch, weights: str, alpha: float = 0.5):
    """(sum of w * CE, weight sum, valid blocks) with the logits materialised and
    F.cross_entropy; `weights` 'dpace', 'gamma' or 'unit' (every labelled row 1)."""
    labels, gamma_w = block_labels(
        batch.input_ids, batch.loss_mask, batch.cu_seqlens, batch.anchors, drafter.cfg.block_size
    )
    hidden = drafter(batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors)  # [A, B, H]
    logits = hidden.float() @ drafter.lm_head_weight.float().T  # [A, B, V]
    ce = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view_as(labels)
    valid = labels != IGNORE_INDEX
    if weights == "dpace":
        w = dpace_weights(ce.detach(), valid, alpha)
    else:
        w = gamma_w if weights == "gamma" else valid.float()
    return (w * ce).sum(), w.sum(), valid[:, 1:].any(1).sum().float()


def _grads(drafter, loss):
    drafter.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)  # some tests take two normalisations of one forward
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-7) for k in a)


@pytest.mark.parametrize(
    "normalise, loss_method",
    [("weight", "exact"), ("anchors", "exact"), ("weight", "odds"), ("weight", "odds_epilogue")],
)
def test_dpace_loss_and_gradient_equal_the_explicit_objective(two_batches, normalise, loss_method):
    # precision.loss_method changes how the softmax is formed, not the objective ('odds_epilogue' is
    # 'odds' on a CPU)
    _, drafter, (batch, _) = two_batches
    loss, norm, _ = batch_objective(
        drafter,
        drafter,
        batch,
        block_size=drafter.cfg.block_size,
        gamma=None,
        autocast="none",
        weights="dpace",
        dpace_alpha=0.3,
        normalise=normalise,
        loss_method=loss_method,
    )
    got = _grads(drafter, loss / norm)
    ce_sum, w_sum, blocks = _explicit_parts(drafter, batch, "dpace", alpha=0.3)
    want_norm = blocks if normalise == "anchors" else w_sum
    torch.testing.assert_close(loss, ce_sum, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(norm, want_norm)
    assert _close(got, _grads(drafter, ce_sum / want_norm))
    gamma_loss = batch_objective(
        drafter, drafter, batch, block_size=drafter.cfg.block_size, gamma=None, autocast="none"
    )[0]
    assert not torch.allclose(gamma_loss, loss, rtol=0.05)  # the lever changes the objective


@pytest.mark.parametrize(
    "weights, normalise, path_weight, loss_method",
    [
        ("dpace", "weight", 0.0, "exact"),
        ("gamma", "weight", 0.0, "exact"),
        ("gamma", "anchors", 1.0, "exact"),
        ("dpace", "weight", 0.0, "odds"),
    ],
)
def test_the_ce_figure_is_every_labelled_positions_mean_ce_whatever_the_objective_weighs(
    two_batches, weights, normalise, path_weight, loss_method
):
    """What a training record reports as `ce` beside its objective's loss: the plain mean CE over
    the labelled rows (logits materialised, F.cross_entropy), the same under every weighting, so
    it compares with validation's."""
    _, drafter, (batch, _) = two_batches
    found: dict = {}
    batch_objective(
        drafter,
        drafter,
        batch,
        block_size=drafter.cfg.block_size,
        gamma=None,
        autocast="none",
        weights=weights,
        normalise=normalise,
        path_weight=path_weight,
        loss_method=loss_method,
        extras=found,
    )
    with torch.no_grad():
        want_sum, want_rows, _ = _explicit_parts(drafter, batch, "unit")
    ce_sum, rows = found["ce"].tolist()
    assert rows == want_rows.item()
    torch.testing.assert_close(ce_sum / rows, (want_sum / want_rows).item(), rtol=1e-5, atol=1e-5)


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


def _path_by_loop(anchors, accepted, loss_mask, cu_seqlens) -> list[bool]:
    """Greedy serving's blocks, walked position by position: per response (a run of loss-mask
    positions inside one sequence) from its first anchor, a -> the first anchor at or after
    a + accepted(a) + 1."""
    anchors, accepted, mask, cu = (
        anchors.tolist(),
        accepted.tolist(),
        loss_mask.bool().tolist(),
        cu_seqlens.tolist(),
    )
    index = {a: i for i, a in enumerate(anchors)}
    on = [False] * len(anchors)
    for start, end in zip(cu[:-1], cu[1:]):
        p = start
        while p < end:
            if not mask[p]:
                p += 1
                continue
            stop = p
            while stop < end and mask[stop]:
                stop += 1  # the response is [p, stop)
            a = next((q for q in range(p, stop) if q in index), None)
            while a is not None:
                on[index[a]] = True
                a = next((q for q in range(a + accepted[index[a]] + 1, stop) if q in index), None)
            p = stop
    return on


@pytest.mark.parametrize(
    "max_anchors", [2, 5, 1000]
)  # sparse to dense: every response position an anchor
def test_serving_path_equals_a_loop_over_the_positions(max_anchors):
    g = torch.Generator().manual_seed(max_anchors)
    on_off = [0, 0]
    for trial in range(30):
        block = int(torch.randint(2, 9, (1,), generator=g))
        lengths = torch.randint(
            2 * block, 80, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g
        )
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        # each sequence: a prompt, then alternating response and user runs (several turns)
        mask = torch.cat(
            [
                (torch.rand(n, generator=g) < 0.85).int().cummax(0).values.bool()
                & ~((torch.arange(n) % 23) < int(torch.randint(0, 4, (1,), generator=g)))
                for n in lengths.tolist()
            ]
        )
        anchors = sample_anchors(mask, cu, block, max_anchors, g, "label" if trial % 2 else "block")
        accepted = torch.randint(0, block, (anchors.numel(),), generator=g)
        accepted = torch.where(
            torch.rand(anchors.numel(), generator=g) < 0.3, 0, accepted
        )  # many rejections at 1
        got = serving_path(anchors, accepted, mask, cu)
        want = _path_by_loop(anchors, accepted, mask, cu)
        assert got.tolist() == want, trial
        on_off[0] += sum(want)
        on_off[1] += len(want) - sum(want)
    assert on_off[0] > 0 and on_off[1] > 0  # the path skips blocks and takes others
    for n in (
        1,
        2,
        3,
        5,
        9,
        64,
        65,
    ):  # the longest path: every position an anchor, every first draft rejected
        every = torch.arange(n)
        assert serving_path(
            every,
            torch.zeros(n, dtype=torch.long),
            torch.ones(n + 1, dtype=torch.bool),
            torch.tensor([0, n + 1]),
        ).all(), n


def _forced_acceptance(drafter, batch):
    """The batch with the token after every other anchor set to the drafter's own first draft there:
    those blocks accept a draft, so the serving path skips blocks (an untrained drafter accepts
    none, and then every anchor lies on the path)."""
    with torch.no_grad():
        hidden = drafter(
            batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors
        )  # [A, B, H]
        first = (hidden[:, 1].float() @ drafter.lm_head_weight.float().T).argmax(-1)  # [A]
    ids = batch.input_ids.clone()
    ids[batch.anchors[::2] + 1] = first[::2]
    return dataclasses.replace(batch, input_ids=ids)


def _todays_objective(drafter, batch, weights: str, normalise: str, alpha: float = 0.5):
    """batch_objective as it was before objective.path_weight: (loss sum, normaliser)."""
    labels, w = block_labels(
        batch.input_ids, batch.loss_mask, batch.cu_seqlens, batch.anchors, drafter.cfg.block_size
    )
    valid = labels != IGNORE_INDEX
    hidden = drafter(batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors)
    row_w = valid.float() if weights == "dpace" else w
    out = fused_lm_head_loss(
        hidden.flatten(0, 1), drafter.lm_head_weight, labels.flatten(), row_w.flatten()
    )
    if weights == "dpace":
        w = dpace_weights(out.rows.detach().view_as(labels), valid, alpha)
        loss = (w.flatten() * out.rows).sum()
    else:
        loss = out.loss
    return loss, valid[:, 1:].any(1).sum().float() if normalise == "anchors" else w.sum()


@pytest.mark.parametrize("weights", ["gamma", "dpace"])
@pytest.mark.parametrize("normalise", ["weight", "anchors"])
def test_path_weight_zero_is_todays_objective_bit_for_bit(two_batches, weights, normalise):
    _, drafter, (batch, _) = two_batches
    batch = _forced_acceptance(drafter, batch)
    kw = dict(
        block_size=drafter.cfg.block_size,
        gamma=None,
        autocast="none",
        weights=weights,
        normalise=normalise,
    )
    loss, norm, _ = batch_objective(drafter, drafter, batch, path_weight=0.0, **kw)
    want_loss, want_norm = _todays_objective(drafter, batch, weights, normalise)
    assert torch.equal(loss, want_loss) and torch.equal(norm, want_norm)
    got, want = _grads(drafter, loss / norm), _grads(drafter, want_loss / want_norm)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    on = batch_objective(drafter, drafter, batch, path_weight=1.0, **kw)
    assert not _close(got, _grads(drafter, on[0] / on[1]))  # and on, the lever changes the step


def _explicit_path_parts(drafter, batch, weights: str, path_weight: float):
    """(sum of w * CE, weight sum, weighted blocks, on-path mask) with materialised logits, accepted
    drafts counted one block at a time and the path walked by `_path_by_loop`."""
    labels, gamma_w = block_labels(
        batch.input_ids, batch.loss_mask, batch.cu_seqlens, batch.anchors, drafter.cfg.block_size
    )
    hidden = drafter(batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors)
    logits = hidden.float() @ drafter.lm_head_weight.float().T  # [A, B, V]
    ce = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view_as(labels)
    valid = labels != IGNORE_INDEX
    hit = ((logits.argmax(-1) == labels) & valid).tolist()
    accepted = torch.tensor(
        [next((k - 1 for k in range(1, len(row)) if not row[k]), len(row) - 1) for row in hit]
    )
    on = torch.tensor(_path_by_loop(batch.anchors, accepted, batch.loss_mask, batch.cu_seqlens))
    base = dpace_weights(ce.detach(), valid, 0.5) if weights == "dpace" else gamma_w
    block_w = torch.where(on, 1.0 + path_weight, 1.0)  # on the path (1 + w) times the weight off it
    w = base * block_w[:, None]
    return (w * ce).sum(), w.sum(), (valid[:, 1:].any(1) * block_w).sum(), on


@pytest.mark.parametrize("weights", ["gamma", "dpace"])
@pytest.mark.parametrize("normalise", ["weight", "anchors"])
def test_blocks_on_the_serving_path_weigh_one_plus_path_weight_times(
    two_batches, weights, normalise
):
    cfg, drafter, (batch, _) = two_batches
    batch = _forced_acceptance(drafter, batch)
    loss, norm, _ = batch_objective(
        drafter,
        drafter,
        batch,
        block_size=drafter.cfg.block_size,
        gamma=None,
        autocast="none",
        weights=weights,
        normalise=normalise,
        path_weight=2.0,
    )
    ce_sum, w_sum, blocks, on = _explicit_path_parts(drafter, batch, weights, 2.0)
    assert 0 < int(on.sum()) < on.numel()  # some blocks on the path, some skipped
    want_norm = blocks if normalise == "anchors" else w_sum
    torch.testing.assert_close(loss, ce_sum, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(norm, want_norm)
    want = _grads(drafter, ce_sum / want_norm)
    cfg = _with(cfg, weights=weights, normalise=normalise, path_weight=2.0)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, grad_accum=1))
    assert _close(
        accumulate(drafter, drafter, cfg, [batch]), want
    )  # the trainer's step passes the option on
    off = _explicit_path_parts(drafter, batch, weights, 0.0)
    assert not _close(
        want, _grads(drafter, off[0] / (off[2] if normalise == "anchors" else off[1]))
    )


def test_feature_noise_is_seeded_per_batch_and_relative_to_each_layers_rms():
    torch.manual_seed(0)
    features = torch.cat(
        [torch.randn(4000, 32) * 0.01, torch.randn(4000, 32) * 100.0], dim=1
    )  # K=2, H=32
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


def test_noise_changes_training_steps_but_never_validation(
    tiny_store, tiny_target, tmp_path, one_thread
):
    from test_loop import _args, _cfg

    figures = {}
    for noise in (0.0, 0.5):
        r = loop.setup(
            _cfg(
                *_args(
                    tiny_store,
                    tiny_target,
                    tmp_path / f"n{noise}",
                    "--optim.max_steps=1",
                    "--run.device=cpu",
                    f"--regularise.noise={noise}",
                )
            ),
            start_ranks("cpu"),
        )
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
    optimizer, scheduler = build_optimizer(cfg.optim, drafter, total=10, device=torch.device("cpu"))
    start = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    ema = WeightAverage(drafter, 0.8)
    want = dict(start)
    sums = torch.zeros(loop._N + 1, dtype=torch.float64)
    counts = torch.zeros(2 * drafter.cfg.block_size + 2, dtype=torch.float64)
    for step in range(3):
        loop.train_step(
            drafter,
            drafter,
            iter(batches[step % 2 : step % 2 + 1]),
            optimizer,
            scheduler,
            cfg,
            sums,
            counts,
            ema,
        )
        want = {n: 0.8 * want[n] + 0.2 * p.detach() for n, p in drafter.named_parameters()}
    trained = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    state = ema.state_dict()
    assert all(torch.allclose(state[n], want[n], rtol=1e-6, atol=1e-7) for n in want)
    with ema.swapped_in():
        assert all(torch.equal(p, state[n]) for n, p in drafter.named_parameters())
    assert all(
        torch.equal(p, trained[n]) for n, p in drafter.named_parameters()
    )  # trained weights back
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
    loop._resume_average(
        tmp_path, None, drafter, ema
    )  # written without an EMA: it starts from the weights
    assert all(torch.equal(s, trained[n]) for n, s in ema.state_dict().items())
    loop._resume_average(
        tmp_path, start, drafter, None
    )  # the EMA turned off: train on the trained weights
    assert all(torch.equal(p, start[n]) for n, p in drafter.named_parameters())
