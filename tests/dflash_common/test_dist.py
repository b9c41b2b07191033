"""dflash_common.dist: devices, and the ranks of a job alone and as two gloo processes (the torchrun
jobs of tests/precompute/test_job.py and tests/train/test_loop.py run them end to end)."""

from __future__ import annotations

import errno
import socket

import pytest
import torch
import torch.multiprocessing as mp

from dflash_common.dist import Ranks, resolve_device, run_on_ranks, start_ranks
from dflash_common.errors import UserError


def test_devices_resolve_to_this_ranks_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="run.device = 'cuda' but no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(UserError, match="target.device = 'cuda:1' but no CUDA GPU"):
        resolve_device("cuda:1", "target.device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    # an index is always set: torch.cuda.set_device and streams refuse a bare 'cuda'
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_one_rank_without_torchrun_calls_through(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    ranks = start_ranks("cpu")
    assert ranks == Ranks(0, 1, torch.device("cpu")) and ranks.main
    assert ranks.gather({"a": 1}) == [{"a": 1}]
    assert ranks.from_main(lambda: 7) == 7
    assert ranks.any(True) and not ranks.any(False)
    assert ranks.label("precompute") == "precompute"
    assert Ranks(0, 4, torch.device("cpu")).label("generate") == "generate, rank 0 of 4"
    with pytest.raises(ValueError, match="rank 0's"):
        ranks.from_main(lambda: (_ for _ in ()).throw(ValueError("rank 0's")))


def _full(why: str) -> str:
    return f"the disk is full ({why}); free space and rerun."


def test_a_full_disk_in_the_block_is_one_sentence_and_other_errors_pass(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UserError) as e:
        with run_on_ranks("cpu", full_disk=_full):
            raise OSError(errno.ENOSPC, "No space left on device", "/x/.tmp-123")
    assert str(e.value) == "the disk is full (No space left on device); free space and rerun."
    with pytest.raises(UserError, match="^mine$"):  # a UserError of the block is its own sentence
        with run_on_ranks("cpu", full_disk=_full):
            raise UserError("mine")
    with pytest.raises(OSError, match="Permission"):
        with run_on_ranks("cpu", full_disk=_full):
            raise OSError(errno.EACCES, "Permission denied")
    with run_on_ranks("cpu", full_disk=_full) as ranks:
        assert ranks.world == 1


def _two_ranks(rank: int, port: int, results) -> None:
    import os

    os.environ.update(
        WORLD_SIZE="2",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    with run_on_ranks("cpu", full_disk=_full) as ranks:
        gathered = ranks.gather(f"from {ranks.rank}")
        decided = ranks.from_main(lambda: {"decided by": ranks.rank})
        anyone = ranks.any(ranks.rank == 1)
        nobody = ranks.any(False)
        try:
            ranks.from_main(lambda: (_ for _ in ()).throw(UserError("rank 0 refuses")))
            refused = None
        except UserError as e:
            refused = str(e)
    results.put((rank, gathered, decided, anyone, nobody, refused))


def test_two_gloo_ranks_gather_decide_and_agree():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_two_ranks, args=(port, results), nprocs=2, start_method="spawn")
    got = sorted(results.get(timeout=60) for _ in range(2))
    for rank, gathered, decided, anyone, nobody, refused in got:
        assert gathered == ["from 0", "from 1"]
        assert decided == {"decided by": 0}
        assert anyone and not nobody
        assert refused == "rank 0 refuses", rank  # rank 0's error, raised on every rank
