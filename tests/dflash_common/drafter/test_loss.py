"""The fused LM-head loss against plain F.cross_entropy on materialised logits, for both backends
(the Triton kernel runs on the CPU through TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_common.drafter.loss import chunk_rows, fused_lm_head_loss, weighted_ce_rows_torch
from dflash_common.drafter.objective import IGNORE_INDEX

BACKENDS = ["torch", "triton"]


def _case(n=37, h=16, v=300, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype).requires_grad_(True)
    weight = torch.randn(v, h, generator=g).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[1::3] = (hidden.detach().float() @ weight.float().T).argmax(-1)[1::3]  # some correct rows
    weights = torch.rand(n, generator=g)
    weights[::5] = 0.0  # zero weight: skipped rows
    labels[3] = labels[10] = IGNORE_INDEX  # ignored labels, one of them with a non-zero weight
    weights[10] = 0.7
    return hidden, weight, labels, weights


def _reference(hidden, weight, labels, weights):
    logits = hidden.float() @ weight.float().T  # [N, V], materialised
    ce = F.cross_entropy(logits, labels, reduction="none", ignore_index=IGNORE_INDEX)
    kept = (weights != 0) & (labels != IGNORE_INDEX)
    return (ce * weights).sum(), (logits.argmax(-1) == labels) & kept


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_bytes", [None, 300 * 8 * 5], ids=["one-chunk", "chunks-of-5-rows"])
def test_value_gradient_and_correctness_match_cross_entropy(backend, chunk_bytes):
    hidden, weight, labels, weights = _case()
    out = fused_lm_head_loss(hidden, weight, labels, weights, backend=backend, chunk_bytes=chunk_bytes)
    (out.loss * 3.0).backward()  # grad_output != 1 scales the stored gradient
    got_grad, hidden.grad = hidden.grad, None
    want, want_correct = _reference(hidden, weight, labels, weights)
    (want * 3.0).backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_grad, hidden.grad, rtol=1e-5, atol=1e-4)
    assert torch.equal(out.correct, want_correct) and out.correct.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_kept_path_and_no_grad_path(backend):
    hidden, weight, labels, weights = _case(n=20, seed=1)
    labels = labels.clamp(min=0)
    weights = weights + 0.1  # nothing skipped: slices instead of gathers
    out = fused_lm_head_loss(hidden, weight, labels, weights, backend=backend)
    out.loss.backward()
    got_grad, hidden.grad = hidden.grad, None
    want, want_correct = _reference(hidden, weight, labels, weights)
    want.backward()
    torch.testing.assert_close(got_grad, hidden.grad, rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        again = fused_lm_head_loss(hidden, weight, labels, weights, backend=backend)
    assert not again.loss.requires_grad
    torch.testing.assert_close(again.loss, want.detach(), rtol=1e-5, atol=1e-4)
    assert torch.equal(again.correct, want_correct)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs_stay_close_to_the_float32_reference(backend):
    hidden, weight, labels, weights = _case(n=24, h=32, seed=2, dtype=torch.bfloat16)
    out = fused_lm_head_loss(hidden, weight, labels, weights, backend=backend)
    out.loss.backward()
    assert hidden.grad.dtype == torch.bfloat16
    got_grad, hidden.grad = hidden.grad.float(), None
    want, _ = _reference(hidden, weight, labels, weights)
    want.backward()
    torch.testing.assert_close(out.loss, want, rtol=2e-2, atol=0.5)
    torch.testing.assert_close(got_grad, hidden.grad.float(), rtol=5e-2, atol=5e-2)


def test_triton_kernel_tiles_the_vocabulary_like_the_torch_rows():
    from dflash_common.drafter.loss_triton import weighted_ce_rows

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 200, generator=g) * 4
    # ties across tiles, in other lanes (7, 190) and in the same lane (7, 71): the first index wins
    logits[2, 190] = logits[2, 7] = logits[2, 71] = 50.0
    logits[5, 195] = 60.0  # the max only in the last, partial tile
    labels = torch.tensor([0, 199, 7, 64, 63, 195])
    weights = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.0, 0.25])
    a, b = logits.clone(), logits.clone()
    loss_t, correct_t = weighted_ce_rows(a, labels, weights, compute_grad=True, block=64)  # 4 tiles, last partial
    loss_r, correct_r = weighted_ce_rows_torch(b, labels, weights, compute_grad=True)
    torch.testing.assert_close(loss_t, loss_r)
    torch.testing.assert_close(a, b)
    assert torch.equal(correct_t, correct_r) and correct_t[2] and correct_t[5]


def test_nothing_to_learn_gives_zero_loss_and_zero_gradient():
    hidden, weight, labels, _ = _case(n=12)
    out = fused_lm_head_loss(hidden, weight, labels, torch.zeros(12), backend="torch")
    out.loss.backward()
    assert out.loss.item() == 0.0 and hidden.grad.abs().sum() == 0 and not out.correct.any()


def test_chunk_rows_follow_the_budget():
    # default: about the size of hidden itself, in 512-row quanta (N=16384, H=4096, V=151936, bf16)
    assert chunk_rows(16384, 4096, 151936, 2, 2) == 512
    assert chunk_rows(65536, 5120, 248320, 2, 2) == 1536
    assert chunk_rows(100, 64, 151936, 2, 2) == 512  # never below one quantum by default
    assert chunk_rows(100, 64, 151936, 2, 2, chunk_bytes=2000 * 151936 * 2) == 1536  # whole quanta
    assert chunk_rows(100, 64, 1000, 2, 2, chunk_bytes=10_000) == 5  # an explicit budget is obeyed


@pytest.mark.gpu
def test_triton_on_the_gpu_matches_the_torch_backend_in_bf16():
    hidden, weight, labels, weights = _case(n=1000, h=256, v=5003, seed=4, dtype=torch.bfloat16)
    hidden = hidden.detach().cuda().requires_grad_(True)
    weight, labels, weights = weight.cuda(), labels.cuda(), weights.cuda()
    grads, losses = [], []
    for backend in BACKENDS:
        out = fused_lm_head_loss(hidden, weight, labels, weights, backend=backend)
        out.loss.backward()
        grads.append(hidden.grad.float())
        losses.append(out.loss)
        hidden.grad = None
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=1e-2)
    # the kernel's 2**(x log2 e) and torch's exp may round a bf16 d_logits value one step apart
    # (2**-8 near 1), and |lm_head| reaches ~4 here: a few elements differ by up to 1.6e-2. A wrong
    # weight or softmax moves every row, which the mean difference catches.
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-2, atol=1.6e-2)
    assert (grads[0] - grads[1]).abs().mean() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_bytes", [None, 300 * 8 * 5], ids=["one-chunk", "chunks-of-5-rows"])
def test_rows_reweighted_after_the_forward_give_the_gradient_of_the_reweighted_objective(backend, chunk_bytes):
    # D-PACE's path: unit weights in the fused forward, per-row weights from its own CE applied after
    hidden, weight, labels, weights = _case(seed=2)
    unit = ((weights != 0) & (labels != IGNORE_INDEX)).float()
    out = fused_lm_head_loss(hidden, weight, labels, unit, backend=backend, chunk_bytes=chunk_bytes)
    logits = hidden.detach().float() @ weight.float().T
    ce = F.cross_entropy(logits, labels, reduction="none", ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(out.rows, ce * unit, rtol=1e-5, atol=1e-5)  # per-row CE, 0 where skipped
    w = torch.exp(-out.rows.detach()) + torch.arange(len(unit)) / 10  # depends on this forward's CE
    (w * out.rows).sum().backward()
    got_grad, hidden.grad = hidden.grad, None
    ref = F.cross_entropy(hidden.float() @ weight.float().T, labels, reduction="none", ignore_index=IGNORE_INDEX)
    (w * unit * ref).sum().backward()
    # atol as in the tests above: the kernel's e**x is 2**(x log2 e), a float32 rounding away
    torch.testing.assert_close(got_grad, hidden.grad, rtol=1e-5, atol=1e-4)
