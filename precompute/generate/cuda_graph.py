"""A decode step of `dflash-generate` replayed as a CUDA graph (generate.cuda_graphs): one launch
per token instead of a few hundred kernel launches from Python."""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("dflash")


class CudaGraph:
    """A decode step over fixed buffers: its first call runs eagerly (the warm-up a capture needs),
    the second captures it as a CUDA graph, and every call from then on replays the graph; the
    output is the graph's own tensor (overwritten by the next replay). The warm-up is a real step,
    never a repeated one: transformers' StaticCache (5.x) advances its own write position on the
    device at every forward and ignores `cache_position`, so an extra forward would shift every
    later write by one slot. If the capture fails (an operation of the model that a graph cannot
    hold), steps run eagerly from then on."""

    def __init__(self, fn: Callable[[], torch.Tensor]):
        self.fn, self.graph, self.out = fn, None, None
        self.calls, self.eager = 0, False

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        if self.eager:
            return self.fn()
        if self.calls == 1:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.fn()  # step 0, eagerly: lazy initialisation happens outside the capture
            torch.cuda.current_stream().wait_stream(side)
            return out
        if self.graph is None:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):  # records the step; runs nothing
                    self.out = self.fn()
            except RuntimeError as e:
                log.warning(
                    "decode step: CUDA graph capture failed (%s); decoding with eager steps", e
                )
                self.eager = True
                return self.fn()
            self.graph = graph
        self.graph.replay()
        return self.out
