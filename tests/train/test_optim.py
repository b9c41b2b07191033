"""The optimiser and its schedule (train/optim.py): AdamW, and Muon + AdamW stepped as one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from train.config import OptimSection
from train.optim import MuonAdamW, build_optimizer, lr_factor, muon_matrices


def test_the_schedule_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    f = [lr_factor(s, 100, 0.04, "cosine", 0.1) for s in range(100)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == 1.0
    assert all(a >= b for a, b in zip(f[4:], f[5:])) and f[-1] == pytest.approx(0.1, abs=1e-3)
    assert f[52] == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-9)  # halfway through the decay
    assert lr_factor(50, 100, 0.04, "constant", 0.0) == 1.0


class _Net(nn.Module):
    """Linear matrices (Muon's), a norm scale, an embedding table and a one-row head (AdamW's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(10, 8)
        self.a = nn.Linear(8, 16, bias=False)
        self.b = nn.Linear(16, 8, bias=False)
        self.scale = nn.Parameter(torch.ones(8))
        self.row = nn.Linear(8, 1)

    def forward(self, ids):
        return self.row(self.b(torch.relu(self.a(self.table(ids)))) * self.scale).sum()


def _step(model, optimizer, scheduler, seed):
    ids = torch.randint(0, 10, (12,), generator=torch.Generator().manual_seed(seed))
    model(ids).backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def test_muon_takes_the_linear_matrices_and_adamw_the_rest():
    net = _Net()
    matrices, others = muon_matrices(net)
    assert {id(p) for p in matrices} == {id(net.a.weight), id(net.b.weight)}
    assert {id(p) for p in others} == {id(net.table.weight), id(net.scale), id(net.row.weight), id(net.row.bias)}


def test_muon_steps_every_parameter_and_follows_the_schedule():
    net = _Net()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    o = OptimSection(name="muon", lr=1e-2, warmup_fraction=0.5)
    optimizer, scheduler = build_optimizer(o, net, total=4, device=torch.device("cpu"))
    assert isinstance(optimizer, MuonAdamW)
    _step(net, optimizer, scheduler, 0)
    assert all(not torch.equal(p, before[n]) for n, p in net.named_parameters()), "every weight moves"
    lrs = [g["lr"] for g in optimizer.muon.param_groups + optimizer.adamw.param_groups]
    assert lrs == pytest.approx([1e-2 * lr_factor(1, 4, 0.5, "cosine", 0.0)] * len(lrs))


def test_a_muon_update_is_orthogonalised():
    """One step from zero momentum moves a matrix by lr * scale * NS(grad): its singular values are
    all near one scale (Newton-Schulz flattens them), where the gradient's are spread out."""
    net = _Net()
    o = OptimSection(name="muon", lr=1.0, warmup_fraction=0.0, schedule="constant")
    optimizer, scheduler = build_optimizer(o, net, total=10, device=torch.device("cpu"))
    w = net.a.weight.detach().clone()
    ids = torch.arange(10)
    net(ids).backward()
    grad_sv = torch.linalg.svdvals(net.a.weight.grad)
    optimizer.step()
    update_sv = torch.linalg.svdvals(net.a.weight.detach() - w)
    assert grad_sv.max() / grad_sv[grad_sv > 1e-6].min() > 3
    assert update_sv.max() / update_sv.min() < 2.5


def test_muon_state_round_trips_so_a_resume_repeats_the_next_step():
    a = _Net()
    o = OptimSection(name="muon", lr=1e-2)
    opt_a, sched_a = build_optimizer(o, a, total=10, device=torch.device("cpu"))
    for seed in range(3):
        _step(a, opt_a, sched_a, seed)
    b = copy.deepcopy(a)
    opt_b, sched_b = build_optimizer(o, b, total=10, device=torch.device("cpu"))
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    sched_b.load_state_dict(sched_a.state_dict())
    for seed in (3, 4):  # two steps: the second at the lr the resumed scheduler set
        _step(a, opt_a, sched_a, seed)
        _step(b, opt_b, sched_b, seed)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert [g["lr"] for g in opt_b.muon.param_groups] == [g["lr"] for g in opt_a.muon.param_groups]


def test_adamw_is_the_recipe_over_every_trainable_weight():
    net = _Net()
    optimizer, _ = build_optimizer(OptimSection(), net, total=10, device=torch.device("cpu"))
    assert type(optimizer) is torch.optim.AdamW
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(net.parameters()))
