"""Host -> device: the GPU holds the batch being trained plus at most one batch being copied in.

Device memory for a batch is allocated once: `1 + gpu_prefetch` sets of raw buffers, per storage
dtype of the stores and per target layer, [batch_tokens, row] in that encoding (bf16 bit patterns as
uint16; fp8 or q4_hadamard bytes plus a float32 scale per token: the dtype flow of
dflash_common/store/quant.py). A batch is copied into a free set on a side stream, straight out of
the pinned cache slots (non-blocking; one copy per sequence and layer, both sides contiguous; a
sequence's rows go to the buffers of its store's dtype), and an event marks the end of the copy. The
compute stream waits for that event, decodes the raw set into the context features [T, K*H] (fp8
and q4_hadamard are decoded here, on the GPU, q4_hadamard by one Triton kernel; rows of stores of
different dtypes are decoded per dtype and put back in batch order) and records a second event,
after which the raw set may take the next batch. No `record_stream`: the buffers are never freed,
and their reuse is ordered by those two events, so nothing handed to the step may alias them (a
bf16 final state is copied out).

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

from dflash_common.store.quant import decode_states, has_scale, row_size, storage_torch_dtype

if TYPE_CHECKING:
    from train.batch import HostBatch


@dataclasses.dataclass
class DeviceBatch:
    """A packed batch on the training device, each field in the one dtype every consumer takes it in
    (the drafter, its objective and losses, validation and path tau convert none of them):

    - features: the compute dtype (bf16 under bf16 autocast, else float32), decoded from the store's
      bits here, on the device; the bits arrive in their storage integer dtype (uint16 for bf16,
      uint8 for fp8 and q4_hadamard: the dtype flow of dflash_common/store/quant.py).
    - input_ids, cu_seqlens, anchors: int64, torch's index dtype. They index tensors (embedding
      rows, labels, sequence ends), meet `arange` and `searchsorted` results (int64) and become
      F.cross_entropy's labels, which must be int64; nothing here reads them as int32 (no varlen
      kernel), so a narrower dtype would only be converted back. They travel as one int64 vector
      (HostBatch.small_tensor) and arrive as its slices: no conversion on the device.
    - loss_mask: bool, the dtype `&`, `~` and `torch.where` take it in; the one conversion, from the
      0/1 it travels as in that vector, is here.
    """

    features: (
        torch.Tensor
    )  # [T, K*H] context features, K layers in the drafter's target_layer_ids order
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    cu_seqlens: torch.Tensor  # int64 [N+1]
    anchors: torch.Tensor  # int64 [A] packed positions, sorted
    tokens: int
    epoch: int
    index: int  # position of this batch in its epoch's plan
    position: dict[str, Any]  # the data-pipeline state that resumes right after this batch
    data_wait_s: float  # time the host waited for the batch to be assembled
    final: torch.Tensor | None = (
        None  # [T, H] the target's final normed states (soft targets), else None
    )


@dataclasses.dataclass
class _Buffers:
    """One set of device buffers (and their small pinned host twins) that a batch is copied into."""

    states: dict[str, list[torch.Tensor]]  # storage dtype -> K x [batch_tokens, row] stored bits
    scales: dict[
        str, list[torch.Tensor] | None
    ]  # storage dtype -> K x float32 [batch_tokens] (scaled)
    # int64 [4 * batch_tokens + 1]: ids, mask, anchors, cu_seqlens, then (stores of several dtypes
    # in one batch) each buffered row's place in the batch (pinned)
    small_host: torch.Tensor
    small_dev: torch.Tensor
    copied: Any = None  # torch.cuda.Event: the copy into this set is done
    decoded: Any = None  # torch.cuda.Event: the compute stream no longer reads this set


class DeviceFeeder:
    """Pulls host batches from `source` and hands out device batches, one copy ahead (or none)."""

    def __init__(
        self,
        source: Iterator[HostBatch],
        position: Callable[[], dict[str, Any]],
        *,
        device: torch.device,
        layers: int,
        hidden: int,
        dtypes: list[str],
        batch_tokens: int,
        feature_dtype: torch.dtype,
        prefetch: int,
        final: bool = False,
    ):
        self.source = source
        self.position = position
        self.device = device
        self.hidden = hidden
        self.feature_dtype = feature_dtype
        self.final = final  # the last of the `layers` raw states is the final state, not a feature
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda and prefetch else None
        self.buffers = [self._buffers(layers, dtypes, batch_tokens) for _ in range(1 + prefetch)]
        self._next_buffer = 0
        # (batch, its buffers, the position after it, host wait, rows per storage dtype)
        self._in_flight: list[
            tuple[HostBatch, _Buffers, dict[str, Any], float, dict[str, int]]
        ] = []
        self._held: list[
            tuple[Any, list]
        ] = []  # (event, handles) waiting for their copies to finish

    def _buffers(self, layers: int, dtypes: list[str], n: int) -> _Buffers:
        dev, small = self.device, 3 * n + 1 + (n if len(dtypes) > 1 else 0)
        return _Buffers(
            states={
                d: [
                    torch.empty(
                        n, row_size(d, self.hidden), dtype=storage_torch_dtype(d), device=dev
                    )
                    for _ in range(layers)
                ]
                for d in dtypes
            },
            scales={
                d: [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(layers)]
                if has_scale(d)
                else None
                for d in dtypes
            },
            small_host=torch.empty(small, dtype=torch.int64, pin_memory=self.cuda),
            small_dev=torch.empty(small, dtype=torch.int64, device=dev),
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
        return self._finish(*self._in_flight.pop(0))

    def _issue(
        self, host: HostBatch, buf: _Buffers, position: dict[str, Any], waited: float
    ) -> None:
        """Start copying `host` into `buf` (on the side stream when there is one)."""
        stream = self.copy_stream or (torch.cuda.current_stream(self.device) if self.cuda else None)
        if buf.copied is not None:
            # its small host twin is about to be overwritten: its last copy must be done
            buf.copied.synchronize()
        small = host.small_tensor()  # int64 [2T + A + N + 1] <= [3 * batch_tokens + 1]
        counts, order = _buffer_rows(host, list(buf.states))
        if order is not None:  # rows of several dtypes: where each buffered row belongs
            small = torch.cat([small, order])
        buf.small_host[: small.numel()].copy_(small)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if buf.decoded is not None:
                stream.wait_event(buf.decoded)
            at = dict.fromkeys(counts, 0)
            for shard, src, dst, n in host.segments:
                data = host.shards[shard]
                states, scales, a = buf.states[data.dtype], buf.scales[data.dtype], at[data.dtype]
                for k, bits in enumerate(data.states):
                    states[k][a : a + n].copy_(bits[src : src + n], non_blocking=self.cuda)
                    if scales is not None:
                        scales[k][a : a + n].copy_(
                            data.scales[k][src : src + n], non_blocking=self.cuda
                        )
                at[data.dtype] = a + n
            buf.small_dev[: small.numel()].copy_(
                buf.small_host[: small.numel()], non_blocking=self.cuda
            )
            if self.cuda:
                buf.copied = torch.cuda.Event()
                buf.copied.record(stream)
        self._held.append((buf.copied, host.take_handles()))
        self._in_flight.append((host, buf, position, waited, counts))

    def _finish(
        self,
        host: HostBatch,
        buf: _Buffers,
        position: dict[str, Any],
        waited: float,
        counts: dict[str, int],
    ) -> DeviceBatch:
        """Decode `buf` into the batch's features on the compute stream."""
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(buf.copied)
        t, n_small = host.tokens, host.small_numel()
        mixed = sum(c > 0 for c in counts.values()) > 1
        order = (
            buf.small_dev[n_small : n_small + t] if mixed else None
        )  # [T] batch row of each buffered row
        feats = [
            self._decode(buf, k, counts, order) for k in range(len(next(iter(buf.states.values()))))
        ]
        final = feats.pop() if self.final else None  # [T, H]
        if final is not None and _shares_memory(final, buf):
            final = (
                final.clone()
            )  # a bf16 view of the buffer, which takes the next batch after the decode
        features = torch.cat(feats, dim=-1)  # K x [T, H] -> [T, K*H]
        small = buf.small_dev[:n_small].clone()  # the batch's own copy: buf takes the next batch
        if self.cuda:
            buf.decoded = torch.cuda.Event()
            buf.decoded.record(compute)
        ids, mask, anchors, cu = host.split_small(small)
        self._release_finished()
        return DeviceBatch(
            features,
            ids,
            mask.bool(),
            cu,
            anchors,
            t,
            host.epoch,
            host.index,
            position,
            waited,
            final,
        )

    def _decode(
        self, buf: _Buffers, k: int, counts: dict[str, int], order: torch.Tensor | None
    ) -> torch.Tensor:
        """State k of the batch [T, H]: each dtype's rows decoded, then (several dtypes) put in
        place."""
        parts = [
            decode_states(
                buf.states[d][k][:c],
                None if buf.scales[d] is None else buf.scales[d][k][:c],
                d,
                out_dtype=self.feature_dtype,
            )
            for d, c in counts.items()
            if c
        ]
        if order is None:
            return parts[0]
        out = torch.empty(len(order), self.hidden, dtype=self.feature_dtype, device=self.device)
        return out.index_copy_(0, order, torch.cat(parts))

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
        """Wait for copies in flight and release everything held (before the cache slab is
        unpinned)."""
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


def _buffer_rows(host: HostBatch, dtypes: list[str]) -> tuple[dict[str, int], torch.Tensor | None]:
    """Rows per storage dtype of a batch, and (several dtypes) the batch row of each buffered row,
    in the order the buffers are filled: dtype after dtype, each in segment order (int64 [T])."""
    counts = dict.fromkeys(dtypes, 0)
    for shard, _, _, n in host.segments:
        counts[host.shards[shard].dtype] += n
    if sum(c > 0 for c in counts.values()) < 2:
        return counts, None
    order = [
        torch.arange(dst, dst + n)
        for d in dtypes
        for shard, _, dst, n in host.segments
        if host.shards[shard].dtype == d
    ]
    return counts, torch.cat(order)


def _shares_memory(x: torch.Tensor, buf: _Buffers) -> bool:
    ptr = x.untyped_storage().data_ptr()
    return any(
        ptr == s.untyped_storage().data_ptr() for states in buf.states.values() for s in states
    )
