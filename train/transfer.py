"""Host -> device: the GPU holds the batch being trained plus at most one batch being copied in.

Device memory for a batch is allocated once: `1 + gpu_prefetch` sets of raw buffers, one per target
layer, [batch_tokens, H] in the store's encoding (bf16 bit patterns, or fp8 bit patterns plus a scale
per token). A batch is copied into a free set on a side stream, straight out of the pinned cache
slots (non-blocking; one copy per sequence and layer, both sides contiguous), and an event marks the
end of the copy. The compute stream waits for that event, decodes the raw set into the bf16 context
features [T, K*H] (fp8 is dequantised here, on the GPU) and records a second event, after which the
raw set may take the next batch. No `record_stream`: the buffers are never freed, and their reuse is
ordered by those two events.

A shard's cache slots are held (its handles are kept) until the event after its copies has
completed; only then are the handles released and the slots free for another shard. On a CPU there
are no streams: copies run in order and handles are released at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

if TYPE_CHECKING:
    from train.batch import HostBatch


@dataclasses.dataclass
class DeviceBatch:
    """A packed batch on the training device, each field in the one dtype every consumer takes it in
    (the drafter, its objective and losses, validation and path tau convert none of them):

    - features: the compute dtype (bf16 under bf16 autocast, else float32), decoded from the store's
      bits here, on the device.
    - input_ids, cu_seqlens, anchors: int64, torch's index dtype. They index tensors (embedding
      rows, labels, sequence ends), meet `arange` and `searchsorted` results (int64) and become
      F.cross_entropy's labels, which must be int64; nothing here reads them as int32 (no varlen
      kernel), so a narrower dtype would only be converted back. They travel as one int64 vector
      (HostBatch.small_tensor) and arrive as its slices: no conversion on the device.
    - loss_mask: bool, the dtype `&`, `~` and `torch.where` take it in; the one conversion, from the
      0/1 it travels as in that vector, is here.
    """

    features: torch.Tensor  # [T, K*H] context features, K layers in the drafter's target_layer_ids order
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    cu_seqlens: torch.Tensor  # int64 [N+1]
    anchors: torch.Tensor  # int64 [A] packed positions, sorted
    tokens: int
    epoch: int
    index: int  # position of this batch in its epoch's plan
    position: dict[str, Any]  # the data-pipeline state that resumes right after this batch
    data_wait_s: float  # time the host waited for the batch to be assembled
    final: torch.Tensor | None = None  # [T, H] the target's final normed states (soft targets), else None


@dataclasses.dataclass
class _Buffers:
    """One set of device buffers (and their small pinned host twins) that a batch is copied into."""

    states: list[torch.Tensor]  # K x [batch_tokens, H] raw (uint16 or uint8)
    scales: list[torch.Tensor] | None  # K x float32 [batch_tokens] (fp8 only)
    small_host: torch.Tensor  # int64 [3 * batch_tokens + 1]: ids, mask, anchors, cu_seqlens (pinned)
    small_dev: torch.Tensor
    copied: Any = None  # torch.cuda.Event: the copy into this set is done
    decoded: Any = None  # torch.cuda.Event: the compute stream no longer reads this set


Decode = Callable[[torch.Tensor, torch.Tensor | None, torch.dtype], torch.Tensor]


class DeviceFeeder:
    """Pulls host batches from `source` and hands out device batches, one copy ahead (or none)."""

    def __init__(self, source: Iterator[HostBatch], position: Callable[[], dict[str, Any]], *,
                 device: torch.device, layers: int, hidden: int, raw_dtype: torch.dtype, scaled: bool,
                 batch_tokens: int, feature_dtype: torch.dtype, decode: Decode, prefetch: int, final: bool = False):
        self.source = source
        self.position = position
        self.device = device
        self.feature_dtype = feature_dtype
        self.decode = decode
        self.final = final  # the last of the `layers` raw states is the final state, not a feature
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda and prefetch else None
        self.buffers = [self._buffers(layers, hidden, raw_dtype, scaled, batch_tokens) for _ in range(1 + prefetch)]
        self._next_buffer = 0
        self._in_flight: list[tuple[HostBatch, _Buffers, dict[str, Any], float]] = []
        self._held: list[tuple[Any, list]] = []  # (event, handles) waiting for their copies to finish

    def _buffers(self, layers: int, hidden: int, raw_dtype: torch.dtype, scaled: bool, n: int) -> _Buffers:
        dev = self.device
        return _Buffers(
            states=[torch.empty(n, hidden, dtype=raw_dtype, device=dev) for _ in range(layers)],
            scales=[torch.empty(n, dtype=torch.float32, device=dev) for _ in range(layers)] if scaled else None,
            small_host=torch.empty(3 * n + 1, dtype=torch.int64, pin_memory=self.cuda),
            small_dev=torch.empty(3 * n + 1, dtype=torch.int64, device=dev),
        )

    def __iter__(self) -> "DeviceFeeder":
        return self

    def __next__(self) -> DeviceBatch:
        self._release_finished()
        while len(self._in_flight) < len(self.buffers):
            started = time.perf_counter()
            host = next(self.source)
            waited = time.perf_counter() - started
            self._issue(host, self.buffers[self._next_buffer], self.position(), waited)
            self._next_buffer = (self._next_buffer + 1) % len(self.buffers)
            if not self.cuda or self.copy_stream is None:
                break  # without a side stream there is nothing to overlap: copy one at a time
        host, buf, position, waited = self._in_flight.pop(0)
        return self._finish(host, buf, position, waited)

    def _issue(self, host: HostBatch, buf: _Buffers, position: dict[str, Any], waited: float) -> None:
        """Start copying `host` into `buf` (on the side stream when there is one)."""
        stream = self.copy_stream or (torch.cuda.current_stream(self.device) if self.cuda else None)
        if buf.copied is not None:
            buf.copied.synchronize()  # its small host twin is about to be overwritten: its last copy must be done
        small = host.small_tensor()  # int64 [2T + A + N + 1] <= [3 * batch_tokens + 1]
        buf.small_host[:small.numel()].copy_(small)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if buf.decoded is not None:
                stream.wait_event(buf.decoded)
            for shard, src, dst, n in host.segments:
                data = host.shards[shard]
                for k, states in enumerate(data.states):
                    buf.states[k][dst:dst + n].copy_(states[src:src + n], non_blocking=self.cuda)
                    if buf.scales is not None:
                        buf.scales[k][dst:dst + n].copy_(data.scales[k][src:src + n], non_blocking=self.cuda)
            buf.small_dev[:small.numel()].copy_(buf.small_host[:small.numel()], non_blocking=self.cuda)
            if self.cuda:
                buf.copied = torch.cuda.Event()
                buf.copied.record(stream)
        self._held.append((buf.copied, host.take_handles()))
        self._in_flight.append((host, buf, position, waited))

    def _finish(self, host: HostBatch, buf: _Buffers, position: dict[str, Any], waited: float) -> DeviceBatch:
        """Decode `buf` into the batch's features on the compute stream."""
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(buf.copied)
        t = host.tokens
        feats = [self.decode(buf.states[k][:t], None if buf.scales is None else buf.scales[k][:t], self.feature_dtype)
                 for k in range(len(buf.states))]
        final = feats.pop() if self.final else None  # [T, H]
        features = torch.cat(feats, dim=-1)  # K x [T, H] -> [T, K*H]
        small = buf.small_dev[:host.small_numel()].clone()  # the batch's own copy: buf takes the next batch
        if self.cuda:
            buf.decoded = torch.cuda.Event()
            buf.decoded.record(compute)
        ids, mask, anchors, cu = host.split_small(small)
        self._release_finished()
        return DeviceBatch(features, ids, mask.bool(), cu, anchors, t, host.epoch, host.index,
                           position, waited, final)

    def _release_finished(self) -> None:
        """Give back the cache slots of every batch whose copies have completed."""
        still = []
        for event, handles in self._held:
            if event is None or event.query():
                for h in handles:
                    h.release()
            else:
                still.append((event, handles))
        self._held = still

    def close(self) -> None:
        """Wait for copies in flight and release everything held (before the cache slab is unpinned)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for host, *_ in self._in_flight:
            for h in host.take_handles():
                h.release()
        self._in_flight.clear()
        for _, handles in self._held:
            for h in handles:
                h.release()
        self._held.clear()
