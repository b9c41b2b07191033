"""DSpark's fused loss (loss/markov.py) against plain PyTorch on full [N, V] logits with the Markov
bias materialised (an nn.Embedding and an nn.Linear, autograd through cross_entropy / log_softmax /
abs): value, per-row CE, correctness, TV, and the gradients of hidden, W1 and W2, under fixed
weights and D-PACE weights formed from the same forward, hard and soft kinds, both backends, chunks
of any size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_common.drafter.loss.markov import Soft, markov_lm_head_loss
from dflash_common.drafter.objective import IGNORE_INDEX, dpace_weights

B, V, H, R = 4, 300, 16, 6


def _case(blocks=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = blocks * B
    hidden = (torch.randn(n, H, generator=g) * 2).requires_grad_(True)
    head = torch.randn(V, H, generator=g)
    w1 = torch.nn.Embedding(V, R)
    w2 = torch.nn.Linear(R, V, bias=False)
    with torch.no_grad():
        w1.weight.copy_(torch.randn(V, R, generator=g))
        w2.weight.copy_(torch.randn(V, R, generator=g))
    prev = torch.randint(0, V, (n,), generator=g)
    labels = torch.randint(0, V, (n,), generator=g)
    base = hidden.detach() @ head.T + w2(w1(prev)).detach()
    labels[2::3] = base.argmax(-1)[2::3]  # some rows the drafter gets right
    labels[[5, 6, 7, 13]] = IGNORE_INDEX  # a block's tail past the sequence end, a gap
    teacher = torch.randn(n + 3, H, generator=g) * 2
    index = torch.randint(0, n + 3, (n,), generator=g)
    return hidden, head, w1, w2, prev, labels, teacher, index


def _weigh(kind, fixed):
    if kind == "dpace":
        return lambda ce, valid, first: dpace_weights(ce, valid, 0.5)
    return lambda ce, valid, first: fixed.view(-1, B)[first : first + ce.shape[0]]


def _reference(hidden, head, w1, w2, prev, labels, teacher, index, weights_kind, fixed, soft):
    logits = hidden @ head.T + w2(w1(prev))  # [N, V], the bias materialised
    valid = labels != IGNORE_INDEX
    safe = labels.clamp(min=0)
    ce = F.cross_entropy(logits, safe, reduction="none") * valid
    per_row, tv = ce, None
    if soft is not None:
        log_p, log_q = logits.log_softmax(-1), (teacher[index] @ head.T).log_softmax(-1)
        l1 = (log_p.exp() - log_q.exp()).abs().sum(-1)
        per_row = {
            "tv": 0.5 * l1,
            "dspark": 0.1 * ce + 0.9 * l1,
            "kl": (log_q.exp() * (log_q - log_p)).sum(-1),
        }[soft]
        tv = 0.5 * l1.detach()
    if weights_kind == "dpace":  # the weights from this forward's own CE, detached
        w = dpace_weights(ce.detach().view(-1, B), valid.view(-1, B), 0.5).flatten()
    else:
        w = fixed * valid
    loss = (w * per_row * valid).sum()
    correct = (logits.argmax(-1) == labels) & valid
    return loss, ce.detach(), w, correct, tv


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "weights_kind,soft", [("gamma", None), ("dpace", None), ("dpace", "dspark"), ("gamma", "kl")]
)
def test_value_and_every_gradient_match_materialised_logits(backend, weights_kind, soft):
    hidden, head, w1, w2, prev, labels, teacher, index = _case(seed=len(str(soft)))
    fixed = torch.rand(labels.shape[0], generator=torch.Generator().manual_seed(3)) + 0.1
    embed = w1(prev)  # the previous tokens' embeddings, through autograd to W1
    out = markov_lm_head_loss(
        hidden,
        head,
        embed,
        w2.weight,
        labels,
        B,
        _weigh(weights_kind, fixed),
        Soft(teacher, index, soft) if soft else None,
        backend=backend,
        chunk_bytes=V * 4 * 9 * (12 if soft else 1),  # a few blocks a chunk
    )
    (out.loss * 3.0).backward()  # a grad_output != 1 scales every stored gradient
    got = [t.grad.clone() for t in (hidden, w1.weight, w2.weight)]
    for t in (hidden, w1.weight, w2.weight):
        t.grad = None
    want, ce, w, correct, tv = _reference(
        hidden, head, w1, w2, prev, labels, teacher, index, weights_kind, fixed, soft
    )
    (want * 3.0).backward()
    torch.testing.assert_close(out.loss, want.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.ce, ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.weights, w.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(out.correct, correct) and correct.any() and not correct.all()
    if soft == "dspark":
        valid = labels != IGNORE_INDEX
        torch.testing.assert_close(out.tv, tv * valid, rtol=1e-4, atol=1e-5)
    else:
        assert out.tv is None
    for name, g, t in zip(("hidden", "W1", "W2"), got, (hidden, w1.weight, w2.weight)):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-4, msg=f"gradient of {name}")
        assert g.abs().sum() > 0


def test_without_grad_the_same_figures():
    hidden, head, w1, w2, prev, labels, teacher, index = _case()
    fixed = torch.ones(labels.shape[0])
    with torch.no_grad():
        plain = markov_lm_head_loss(
            hidden, head, w1(prev), w2.weight, labels, B, _weigh("dpace", fixed)
        )
    trained = markov_lm_head_loss(
        hidden, head, w1(prev), w2.weight, labels, B, _weigh("dpace", fixed)
    )
    torch.testing.assert_close(plain.loss, trained.loss.detach())
    assert torch.equal(plain.correct, trained.correct)


def test_rows_must_be_whole_blocks():
    hidden, head, w1, w2, prev, labels, _, _ = _case()
    with pytest.raises(ValueError, match="whole blocks"):
        markov_lm_head_loss(
            hidden[:-1], head, w1(prev)[:-1], w2.weight, labels[:-1], B, _weigh("dpace", None)
        )
