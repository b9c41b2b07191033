"""Two real batches of the tiny store and a drafter, for the gradient-accumulation tests; run as a
script under torchrun (gloo), each rank trains one of the two batches and rank 0 saves the
gradients."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import train.loop as loop  # noqa: E402
from train.cli import parse  # noqa: E402
from train.data import TrainData  # noqa: E402


def setup(store, target, grad_accum: int, extra: tuple[str, ...] = ()):
    """-> (cfg, drafter, [batch A, batch B]): the first two batches of the plan of one rank;
    `extra`: more config overrides."""
    cfg = parse(
        [
            "--config",
            str(ROOT / "configs" / "tiny.toml"),
            "--store",
            str(store),
            "--out",
            "unused",
            f"--run.target={target}",
            "--run.device=cpu",
            "--data.batch_tokens=1024",
            "--data.holdout_sequences=0",
            "--data.gpu_prefetch=0",
            "--drafter.block_size=4",
            "--objective.max_anchors=64",
            f"--optim.grad_accum={grad_accum}",
            *extra,
        ]
    )
    stores = loop.open_train_stores(cfg)
    dcfg = loop.resolve_drafter(cfg, stores)
    drafter = loop.build_drafter(cfg, dcfg, torch.device("cpu"))
    data = TrainData.build(
        cfg, stores, dcfg.target_layer_ids, rank=0, world=1, device=torch.device("cpu")
    )
    feeder = data.start()
    a, b = next(feeder), next(feeder)
    data.close()
    # the tiny store's answers all have one length, so both batches hold as many anchors; keep a
    # third of B's, as a batch of short answers would have, so that their weights differ
    return cfg, drafter, [a, dataclasses.replace(b, anchors=b.anchors[::3].clone())]


def accumulate(model, drafter, cfg, batches) -> dict[str, torch.Tensor]:
    """accumulate_gradients over `batches` -> the drafter's gradients by parameter name."""
    sums = torch.zeros(loop._N + 1, dtype=torch.float64)
    counts = torch.zeros(2 * drafter.cfg.block_size + 2, dtype=torch.float64)
    drafter.zero_grad(set_to_none=True)
    loop.accumulate_gradients(model, drafter, iter(batches), cfg, sums, counts)
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


if __name__ == "__main__":  # torchrun --nproc-per-node=2 grad_helpers.py STORE TARGET OUT [OPTIONS]
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg, drafter, batches = setup(sys.argv[1], sys.argv[2], grad_accum=1, extra=tuple(sys.argv[4:]))
    grads = accumulate(DDP(drafter), drafter, cfg, [batches[rank]])
    if rank == 0:
        torch.save(grads, sys.argv[3])
    dist.destroy_process_group()
