"""DSpark's fused loss (loss/markov.py: the Markov bias inside the logits, D-PACE weights formed a
chunk at a time, W2's gradient) against DFlash's (loss/hard.py, D-PACE applied in the backward),
forward and backward, on the rows one training step gives each at equal drafts a cycle:

    PYTHONPATH=. python benchmarks/markov_loss.py            # GPU: Qwen3-8B shape, bf16
    PYTHONPATH=. python benchmarks/markov_loss.py --quick    # CPU: hidden 512, vocab 32768, float32

Rows: A anchors x 16 for DFlash, its row 0 dropped (15 loss rows a block), A x 15 for DSpark (every
row a prediction): the same loss rows. DSpark's extra work is 6NVr against 4NVH. The two run in
turn, `--repeats` times (a shared machine's slow spells hit both); the table gives the median and
range of each and their ratio. `--profile` adds the operators' summed time of two calls of each
(torch.profiler; steadier than wall time where other jobs share the cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import Spread, wall_times  # noqa: E402
from dflash_common.drafter.loss import fused_lm_head_loss  # noqa: E402
from dflash_common.drafter.loss.markov import markov_lm_head_loss  # noqa: E402
from dflash_common.drafter.objective import IGNORE_INDEX, dpace_weights  # noqa: E402


def make_inputs(anchors: int, block: int, h: int, v: int, r: int, device, dtype):
    g = torch.Generator().manual_seed(0)
    head = (torch.randn(v, h, generator=g) * h**-0.5).to(device, dtype)
    dflash_hidden = torch.randn(anchors * block, h, generator=g).to(device, dtype).requires_grad_()
    labels = torch.randint(0, v, (anchors, block), generator=g)
    dflash_labels = labels.clone()
    dflash_labels[:, 0] = IGNORE_INDEX  # DFlash's row 0 is the anchor
    dspark_hidden = (
        torch.randn(anchors * (block - 1), h, generator=g).to(device, dtype).requires_grad_()
    )
    w1 = torch.nn.Embedding(v, r).to(device)
    w2 = torch.nn.Parameter(torch.randn(v, r, generator=g).to(device) * 0.02)
    prev = torch.randint(0, v, (anchors * (block - 1),), generator=g).to(device)
    return (
        head,
        dflash_hidden,
        dflash_labels.to(device),
        dspark_hidden,
        labels[:, 1:].to(device),
        w1,
        w2,
        prev,
    )


def dflash_step(head, hidden, labels):
    valid = labels != IGNORE_INDEX
    out = fused_lm_head_loss(hidden, head, labels.flatten(), valid.flatten().float())
    w = dpace_weights(out.rows.detach().view_as(labels), valid, 0.5)
    (w.flatten() * out.rows).sum().backward()


def dspark_step(head, hidden, labels, w1, w2, prev, block):
    def weigh(ce, ok, first):
        return dpace_weights(ce, ok, 0.5)

    out = markov_lm_head_loss(hidden, head, w1(prev), w2, labels.flatten(), block, weigh)
    out.loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="CPU: hidden 512, vocab 32768, rank 32"
    )
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--profile", action="store_true", help="also the operators' time (profiler)"
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    h, v, r, anchors = (4096, 151936, args.rank, args.anchors) if cuda else (512, 32768, 32, 128)
    dtype = torch.bfloat16 if cuda else torch.float32
    head, fh, fl, dh, dl, w1, w2, prev = make_inputs(anchors, 16, h, v, r, device, dtype)
    steps = {
        "DFlash (hard.py), B = 16": lambda: dflash_step(head, fh, fl),
        f"DSpark (markov.py), B = 15, r = {r}": lambda: dspark_step(head, dh, dl, w1, w2, prev, 15),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}  # process CPU time (CPU runs)
    for step in steps.values():
        wall_times(step, 0, 2, cuda)  # warm-up
    for _ in range(args.repeats):
        for name, step in steps.items():
            start = time.process_time()
            times[name] += wall_times(step, 1, 0, cuda)
            cpu[name].append(time.process_time() - start)
    where = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"# fused loss, forward + backward, D-PACE weights, on {where}: hidden {h}, vocab {v}, "
          f"{anchors} anchors, {str(dtype).removeprefix('torch.')}; {args.repeats} alternating "
          "repeats; on a CPU also the process's CPU time, which other jobs on the cores do not "
          "inflate")
    print(f"| {'loss':<34} | {'wall ms [lowest-highest]':>28} | {'vs DFlash':>9} | "
          f"{'CPU ms [lowest-highest]':>28} | {'vs DFlash':>9} |")
    print(f"|{'-' * 36}|{'-' * 30}|{'-' * 11}|{'-' * 30}|{'-' * 11}|")
    base = None
    for name in steps:
        spread, used = Spread.of(times[name]).scaled(1e3), Spread.of(cpu[name]).scaled(1e3)
        base = base or (spread.median, used.median)
        cpu_cells = (f"{used.text():>28} | {used.median / base[1]:>9.3f}" if not cuda
                     else f"{'n/a':>28} | {'':>9}")
        ratio = spread.median / base[0]
        print(f"| {name:<34} | {spread.text():>28} | {ratio:>9.3f} | {cpu_cells} |")
    if args.profile:
        _operator_times(steps, cuda)


def _operator_times(steps: dict, cuda: bool) -> None:
    """Summed operator time of two calls of each (CPU ops; on CUDA the kernels' device time)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    base = None
    for name, step in steps.items():
        with profile(activities=[activity]) as prof:
            step()
            step()
        events = prof.key_averages()
        total = (
            sum(e.self_device_time_total if cuda else e.self_cpu_time_total for e in events) / 2e3
        )
        mm = (
            sum(
                (e.self_device_time_total if cuda else e.self_cpu_time_total)
                for e in events
                if e.key in ("aten::mm", "aten::addmm") or "gemm" in e.key.lower()
            )
            / 2e3
        )
        base = base or total
        print(
            f"{name}: operators {total:,.1f} ms a call (matmuls {mm:,.1f} ms), {total / base:.3f}x"
        )


if __name__ == "__main__":
    main()
