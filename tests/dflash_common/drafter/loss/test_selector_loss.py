"""DFlash2's objective against a plain-torch one on materialised logits: the fused loss's top-k, the
selector loss with either candidate set, and the whole step objective (per-position CE, its weights,
the selector term and the served walk's counts) with gradients into every parameter."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dflash_common.drafter.loss.hard import fused_lm_head_loss
from dflash_common.drafter.loss.selector import candidate_dot, top_k_logits
from dflash_common.drafter.objective import (
    IGNORE_INDEX,
    accepted_drafts,
    block_labels,
    dpace_weights,
)
from train.config import ObjectiveSection
from train.objective import batch_objective

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from drafter_testlib import packed_batch, randomise_dflash2, tiny_config, tiny_drafter  # noqa: E402

K = 4


@pytest.mark.parametrize(
    "backend, method",
    [
        ("torch", "exact"),
        ("triton", "exact"),
        ("torch", "odds"),
        ("triton", "odds"),
        ("triton", "odds_epilogue"),
    ],
)
def test_the_fused_loss_hands_over_each_kept_rows_top_k(backend, method):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(29, 16, generator=g, requires_grad=True)
    weight = torch.randn(300, 16, generator=g)
    labels = torch.randint(0, 300, (29,), generator=g)
    weights = torch.rand(29, generator=g)
    weights[::4] = 0.0
    labels[5] = IGNORE_INDEX
    plain = fused_lm_head_loss(hidden, weight, labels, weights, backend=backend, method=method)
    out = fused_lm_head_loss(
        hidden,
        weight,
        labels,
        weights,
        backend=backend,
        method=method,
        top_k=K,
        chunk_bytes=8 * 300 * 4,
    )  # several chunks
    values, ids = torch.topk(hidden.detach() @ weight.T, K)
    kept = (weights != 0) & (labels != IGNORE_INDEX)
    assert torch.equal(out.top_ids[kept], ids[kept])
    torch.testing.assert_close(out.top_values[kept], values[kept])
    assert out.top_ids[~kept].eq(0).all() and out.top_values[~kept].eq(float("-inf")).all()
    torch.testing.assert_close(out.loss, plain.loss)  # the loss itself is unchanged
    assert torch.equal(out.correct, plain.correct)
    got = torch.autograd.grad(out.loss, hidden)[0]
    torch.testing.assert_close(got, torch.autograd.grad(plain.loss, hidden)[0])
    ids2, values2 = top_k_logits(hidden.detach(), weight, K)  # the pass for losses that give none
    assert torch.equal(ids2, ids) and torch.equal(values2, values)


def test_the_bilinear_term_and_its_gradients_are_the_gathered_einsums():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(20, 8, generator=g, dtype=torch.float64, requires_grad=True)
    table = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 50, (20, 5), generator=g)
    ids[0] = 7  # a row whose candidates repeat: the table's gradient accumulates
    assert torch.autograd.gradcheck(lambda a, b: candidate_dot(a, b, ids), (q, table))
    torch.testing.assert_close(
        candidate_dot(q, table, ids), torch.einsum("mr,mkr->mk", q, table[ids])
    )


def _batch(cfg, seed=0):
    context, input_ids, cu = packed_batch(cfg, seed=seed)
    input_ids = input_ids % 6  # tokens the head below favours: labels inside and outside the top-k
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    mask[[2, 3, 15]] = False
    anchors = torch.tensor([0, 3, 6, 7, 11, 12, 18, 27])
    return SimpleNamespace(
        features=context, input_ids=input_ids, loss_mask=mask, cu_seqlens=cu, anchors=anchors
    )


def _drafter(tiny_target, seed=0):
    cfg = tiny_config(tiny_target, arch="dflash2", selector_rank=8, selector_top_k=K)
    drafter = randomise_dflash2(tiny_drafter(cfg, seed=seed), seed=seed)
    with torch.no_grad():  # six tokens with large head rows fill most top-k lists
        drafter.lm_head_weight[:6].mul_(20.0)
    return cfg, drafter


def _reference(drafter, batch, b, candidates, weights, alpha=0.5, selector_weight=1.0, stop=False):
    """The objective on materialised logits, position by position."""
    labels, w = block_labels(batch.input_ids, batch.loss_mask, batch.cu_seqlens, batch.anchors, b)
    valid = labels != IGNORE_INDEX
    hidden = drafter(batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors)  # [A, B, H]
    logits = hidden.float() @ drafter.lm_head_weight.float().T  # [A, B, V]
    ce = (
        F.cross_entropy(
            logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none"
        ).view_as(w)
        * valid
    )
    values, ids = torch.topk(logits.detach(), K)
    in_top = (ids == labels[..., None]).any(-1) & valid
    h = hidden.detach() if stop else hidden
    unary = torch.gather(
        h.float() @ drafter.lm_head_weight.float().T, -1, ids
    )  # the same values, with grad
    if candidates == "gold":
        miss = ~in_top & valid
        ids = ids.clone()
        ids[..., -1] = torch.where(miss, labels.clamp(min=0), ids[..., -1])
        unary = torch.gather(h.float() @ drafter.lm_head_weight.float().T, -1, ids)
    pos = (batch.anchors[:, None] + torch.arange(b) - 1).clamp(min=0)
    sel = drafter.candidate_selector
    q = sel.predecessor_codebook[batch.input_ids[pos]] * sel.hidden_projection(h)  # [A, B, r]
    scores = unary + (sel.successor_codebook[ids] * q[..., None, :]).sum(-1)  # [A, B, K]
    target = (ids == labels[..., None]).int().argmax(-1)
    sce = F.cross_entropy(scores.flatten(0, 1), target.flatten(), reduction="none").view_as(w)
    sce = torch.where(valid & (in_top if candidates == "strict" else valid), sce, 0.0)
    if weights == "dpace":
        w = dpace_weights(torch.where(in_top, sce.detach(), torch.inf), valid, alpha)
    correct = in_top & (scores.argmax(-1) == target)
    return (w * ce).sum() + selector_weight * (w * sce).sum(), w.sum(), correct, valid


@pytest.mark.parametrize(
    "candidates, weights, stop",
    [
        ("gold", "gamma", False),
        ("strict", "gamma", False),
        ("gold", "dpace", False),
        ("strict", "dpace", True),
    ],
)
def test_the_step_objective_is_the_plain_one(tiny_target, candidates, weights, stop):
    cfg, drafter = _drafter(tiny_target)
    batch, b = _batch(cfg), cfg.block_size
    loss, norm, counts = batch_objective(
        drafter,
        drafter,
        batch,
        block_size=b,
        gamma=None,
        autocast="none",
        weights=weights,
        objective=ObjectiveSection(selector_candidates=candidates, selector_stop_gradient=stop),
    )
    grads = torch.autograd.grad(loss, list(drafter.parameters()), allow_unused=True)
    want, want_norm, correct, valid = _reference(drafter, batch, b, candidates, weights, stop=stop)
    want_grads = torch.autograd.grad(want, list(drafter.parameters()), allow_unused=True)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(norm, want_norm)
    for (name, _), got, ref in zip(drafter.named_parameters(), grads, want_grads):
        assert got is not None and ref is not None, name
        rel = float((got - ref).norm() / ref.norm().clamp(min=1e-12))
        assert rel < 1e-5, f"{name}: relative gradient difference {rel:.3g}"
    assert valid.sum() > 10 and correct.any()  # the case has served hits to count
    accepted = accepted_drafts(correct, valid)
    assert float(counts[-2]) == float(accepted.sum()) and torch.equal(
        counts[:b], (correct & valid).sum(0).double()
    )


def test_the_selector_term_moves_the_gradient_and_unary_confidence_differs(tiny_target):
    cfg, drafter = _drafter(tiny_target)
    batch = _batch(cfg)
    args = dict(block_size=cfg.block_size, gamma=None, autocast="none")
    base, _, _ = batch_objective(
        drafter, drafter, batch, **args, objective=ObjectiveSection(selector_weight=0.0)
    )
    full, _, _ = batch_objective(drafter, drafter, batch, **args)
    assert full.item() > base.item()
    served, _, _ = batch_objective(drafter, drafter, batch, **args, weights="dpace")
    unary, _, _ = batch_objective(
        drafter,
        drafter,
        batch,
        **args,
        weights="dpace",
        objective=ObjectiveSection(dpace_confidence="unary"),
    )
    assert served.item() != unary.item()
    extras = {}
    batch_objective(drafter, drafter, batch, **args, extras=extras)
    assert extras["unary"].shape == (2 * cfg.block_size + 2,) and extras["selector"][2] > 0
