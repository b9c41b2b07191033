"""benchmarks/profiling.py: the union of kernel intervals and the holes between them (GPU busy and
idle time in `benchmarks/precompute.py --profile`), and the GIL probe."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.profiling import GilProbe, covered  # noqa: E402

MS = 1_000_000  # ns


def test_covered_counts_overlaps_once_and_finds_the_holes():
    spans = [
        (0, 2 * MS),
        (1 * MS, 3 * MS),
        (3 * MS, 4 * MS),  # overlapping and touching: 4 ms
        (4 * MS + MS // 2, 5 * MS),  # a 0.5 ms hole: a kernel boundary, not counted
        (8 * MS, 9 * MS),
        (8 * MS, 8 * MS + 1),
    ]  # a 3 ms hole, then one span inside another
    busy, holes = covered(list(reversed(spans)))
    assert busy == 5.5 and holes == [(5 * MS, 8 * MS)]
    assert covered([]) == (0.0, [])


def test_gil_probe_sees_a_thread_that_holds_the_gil():
    with GilProbe() as quiet:
        time.sleep(0.2)
    stop = threading.Event()

    def spin() -> (
        None
    ):  # pure Python: holds the GIL until the interpreter's switch interval takes it
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        with GilProbe() as busy:
            time.sleep(0.2)
    finally:
        stop.set()
        spinner.join()
    assert quiet.summary_ms()[0] < busy.summary_ms()[0]


def test_a_hole_belongs_to_the_innermost_call_that_spans_half_of_it():
    from torch.autograd.profiler_util import FunctionEvent

    from benchmarks.profiling import _hole_owner

    def event(name, start_ms, end_ms):
        return FunctionEvent(
            id=0, name=name, thread=1, start_us=start_ms * 1e3, end_us=end_ms * 1e3
        )

    calls = [
        event("aten::to", 0, 10),
        event("cudaStreamSynchronize", 1, 9),
        event("aten::add", 9, 9.5),
    ]
    # inside aten::to, shorter
    assert _hole_owner((2 * MS, 8 * MS), calls) == "cudaStreamSynchronize"
    # aten::add spans too little
    assert _hole_owner((9 * MS, 20 * MS), calls).startswith("(no profiled call")
