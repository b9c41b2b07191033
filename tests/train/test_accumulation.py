"""The step's gradient is that of its whole objective (weighted CE summed over every micro-batch of
every rank, over their summed weight), whatever grad_accum and the number of ranks; checked against
the objective's gradient computed directly, and the mean of per-batch means shown to differ."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from grad_helpers import ROOT, accumulate, setup

from train.objective import batch_objective


def _objective_grads(
    drafter, cfg, batches, per_batch_mean: bool = False
) -> dict[str, torch.Tensor]:
    drafter.zero_grad(set_to_none=True)
    parts = [_objective(drafter, cfg, b)[:2] for b in batches]
    if per_batch_mean:
        loss = sum(ls / w for ls, w in parts) / len(parts)
    else:
        loss = sum(ls for ls, _ in parts) / sum(w for _, w in parts)
    loss.backward()
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _objective(drafter, cfg, batch):
    """The batch's (weighted CE sum, weight sum, counts) under the config's objective (D-PACE by
    default)."""
    o = cfg.objective
    return batch_objective(
        drafter,
        drafter,
        batch,
        block_size=drafter.cfg.block_size,
        gamma=o.gamma,
        autocast=cfg.precision.autocast,
        weights=o.weights,
        dpace_alpha=o.dpace_alpha,
        normalise=o.normalise,
    )


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-7) for k in a)


@pytest.fixture(scope="module")
def two_batches(tiny_store, tiny_target, one_thread):
    return setup(tiny_store, tiny_target, grad_accum=2)


def test_two_micro_batches_give_the_gradient_of_their_whole_objective(two_batches):
    cfg, drafter, batches = two_batches
    weights = [float(_objective(drafter, cfg, b)[1]) for b in batches]
    assert weights[0] != pytest.approx(
        weights[1], rel=0.05
    )  # else the two normalisations would agree
    accumulated = accumulate(drafter, drafter, cfg, batches)
    assert _close(accumulated, _objective_grads(drafter, cfg, batches))
    assert not _close(accumulated, _objective_grads(drafter, cfg, batches, per_batch_mean=True))


def test_two_ranks_give_the_gradient_of_one_rank_accumulating_both(
    two_batches, tiny_store, tiny_target, tmp_path
):
    cfg, drafter, batches = two_batches
    out = tmp_path / "grads.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "tests" / "train" / "grad_helpers.py"),
        str(tiny_store),
        str(tiny_target),
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = torch.load(out, weights_only=True)
    assert _close(ddp, _objective_grads(drafter, cfg, batches))
    assert _close(ddp, accumulate(drafter, drafter, cfg, batches))
