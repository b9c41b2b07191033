"""Ranks: this process's place in a torchrun job, its device, and what the ranks do together.

    with run_on_ranks("auto", full_disk=lambda why: f"{out} is full ({why}); ...") as ranks:
        plan = ranks.from_main(make_plan)  # rank 0 decides; every rank gets its answer (or error)
        everyone = ranks.gather(my_stats)  # every rank's object, in rank order, on every rank
        ...                                # leaving the block waits for every rank, then closes

One process per GPU under torchrun (LOCAL_RANK picks the GPU; NCCL on GPUs, gloo on CPUs), any
number of nodes; without torchrun a world of one, where every collective is a plain call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from dflash_common.errors import UserError
from dflash_common.fsutil import is_disk_full, os_reason

# Jobs of windows that ranks compute apart (precompute, generate) meet at the end, where the last
# collective waits for the slowest rank's last window; a failed rank ends the job through torchrun
# long before, so a long timeout costs nothing.
WINDOWS_TIMEOUT = datetime.timedelta(hours=24)


def resolve_device(name: str, field: str = "run.device") -> torch.device:
    """'auto' is this rank's GPU (LOCAL_RANK) when CUDA is there, else the CPU; 'cuda' without an
    index is this rank's GPU too (a device with an index: streams and set_device need one). `field`
    names the config field in the sentence that refuses 'cuda' on a machine without a GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"{field} = {name!r} but no CUDA GPU is visible; use 'cpu' or 'auto'.")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place in the job (world 1 without torchrun)."""

    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def label(self, what: str) -> str:
        """`what`, with 'rank 0 of N' when the job has several ranks (a progress bar's title)."""
        return what if self.world == 1 else f"{what}, rank {self.rank} of {self.world}"

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def from_main(self, fn: Callable[[], Any]) -> Any:
        """Rank 0 runs `fn`; every rank returns its result or raises its error."""
        if self.world == 1:
            return fn()
        box: list[Any] = [None]
        if self.main:
            try:
                box[0] = (True, fn())
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                box[0] = (False, e)
        dist.broadcast_object_list(box, src=0)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank (all ranks get the same answer)."""
        if self.world == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def barrier(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.barrier()

    def finished(self) -> None:
        """Every rank's work is done: wait for the others, so that no rank tears its process group
        down while another still talks to it (seen under gloo: the other rank aborted after its
        work, "terminate called without an active exception", exit -6). Not on an error path: a
        rank that failed must not wait for ranks still working."""
        self.barrier()

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(
    device_choice: str, field: str = "run.device", timeout: datetime.timedelta | None = None
) -> Ranks:
    """Join torchrun's process group if there is one (`timeout`: of its collectives, None for
    torch's default); pick this rank's device (`resolve_device`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = resolve_device(device_choice, field)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        cuda = device.type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo", timeout=timeout, device_id=device if cuda else None
        )
    return Ranks(rank, world, device)


@contextlib.contextmanager
def run_on_ranks(
    device_choice: str,
    *,
    full_disk: Callable[[str], str],
    field: str = "run.device",
    timeout: datetime.timedelta | None = None,
) -> Iterator[Ranks]:
    """The ranks of a job, for the block's work: started on entry; on leaving, every rank waits
    for the others (`Ranks.finished`), and the process group is closed whatever happened. A full
    disk met in the block (by the job's files, its records or its summary) ends it with the
    `UserError` sentence `full_disk(the OS's reason)` says: what is kept, and how to go on."""
    ranks = start_ranks(device_choice, field, timeout)
    try:
        yield ranks
        ranks.finished()
    except UserError:
        raise
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise UserError(full_disk(os_reason(e))) from e
    finally:
        ranks.close()
