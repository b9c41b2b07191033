"""The forward pipeline: the GPU runs batches while earlier states travel to the disk; the GPU never
waits for the disk.

    main thread       forward(batch) -> gather the real tokens and encode them on the GPU (bf16 bit
                      patterns, fp8 e4m3 + a scale per token: half the bytes to copy, or
                      q4_hadamard: 0.28x) in the store's integer dtypes
                      (dflash_common/store/quant.py) -> next batch's forward -> copy the batch
                      before into a staging buffer on the copy stream, record an event
    collector thread  waits for the event, copies each sequence's rows into its unit's host buffers
                      (sequences in input order, whatever the batching order), gives the staging
                      buffer back; a unit whose last sequence arrived goes to the write queue
    writer threads    StoreWriter.write_shard: NaN/Inf scan, compression, checksums, fsync, publish
                      (numpy copies, crc32c and file writes release the GIL)

Back-pressure instead of unbounded RAM: the main thread takes a free staging buffer for every batch
(STAGING_BUFFERS of them, allocated and pinned once at start, sized for `batching.token_budget`
tokens: torch's pinned allocator would round every request up to a power of two), the collector
blocks when `run.queue_depth` finished units wait for the `run.writer_threads` writers, and so the
GPU waits only when the disk cannot keep up (`PipelineStats.wait_s` measures it). Host memory per
rank, counted in work units' states: at most (STAGING_BUFFERS + 2) sort windows (the one being
computed, the one whose last batch waits for its copy, and those whose last batches are still in
staging buffers) + queue_depth + writer_threads, plus the staging buffers themselves
(`PipelineStats.max_units_in_memory` reports the peak).

A batch's copy to the host is queued only after the next batch's forward has been launched. The
model reads a flag back from the GPU at the start of every forward (transformers' packed-sequence
check, one small device-to-host copy and a sync). Queued behind a batch's states (~0.6 GB in bf16,
~11 ms on an H200; most likely both copies share a copy engine), that small copy would wait for them
while the GPU has nothing else queued: one gap as long as the copy, every batch. Queued after the
launch, the states travel while the next forward computes (measured on an H200, docs/benchmarks.md
"Precompute": gaps of >= 1 ms in the GPU's work 25 (288 ms) -> 3 (4 ms) a run, GPU busy 96% -> 99%).
The cost is GPU memory: a batch's encoded states (~0.6 GB in bf16 at a 16K-token budget) stay on
the GPU until their copy ends, early in the next forward, instead of being freed before it starts.

On a CPU the same code runs without streams or events: the copies are plain copies.

Non-finite states stop the run: NaN or Inf in a layer's states almost always comes from the target
(fp16 overflow, a broken checkpoint), not from one sample, so skipping would hide it. The store
refuses the shard naming the sample, layer and token (nothing of that unit is published), the
pipeline stops taking batches, and the run ends with that message; shards published so far are
kept, so after a fix (e.g. `--target.dtype=bf16` instead of fp16) the same command resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from dflash_common.errors import UserError
from dflash_common.fsutil import is_disk_full, os_reason
from dflash_common.store import SHARDS_DIR, NonFiniteStatesError, ShardPayload, StoreWriter
from dflash_common.store.quant import (
    EncodedStates,
    encode_states,
    has_scale,
    row_size,
    storage_numpy_dtype,
    storage_torch_dtype,
)
from precompute.batching import pad_right, plan_batches
from precompute.target import FINAL
from precompute.tokenizing import TokenizedUnit

log = logging.getLogger("dflash")

# One buffer being filled by the GPU while the collector empties the other: the collector's copy
# of a batch is much shorter than the batch's forward, so a third would only cost pinned RAM.
STAGING_BUFFERS = 2
# How often a thread blocked on a queue looks whether another thread failed (nothing is lost
# while busy: a blocked put or get returns as soon as it can).
_POLL_S = 0.1
_PAGE = 4096  # staging regions start on pages: registered (pinned) memory is whole pages
_CUDA_HOST_REGISTER_PORTABLE = 1


@dataclasses.dataclass(frozen=True)
class UnitWork:
    """A unit of a sort window: its tokens, and the shard name when it is to be written (None: it
    is only computed so that the sort window's batches are the same as in a run that writes it)."""

    unit: TokenizedUnit
    name: str | None


@dataclasses.dataclass
class PipelineStats:
    """What one rank's pipeline did (summed into the store's summary)."""

    batches: int = 0
    sequences: int = 0
    tokens: int = 0  # real tokens through the forward
    padded_tokens: int = 0  # token slots of the forward, pads included
    units_written: int = 0  # shards this run published
    units_published_elsewhere: int = 0  # computed, but another job published the same unit first
    bytes_written: int = 0  # on disk, published shards of this run
    setup_s: float = 0.0  # allocating (and pinning) the staging buffers, starting the threads
    wait_s: float = (
        0.0  # main thread blocked on a free staging buffer: the disk was behind (the GPU waits
    )
    # once such a wait outlasts the batch launched before it)
    gpu_busy_s: float = (
        0.0  # GPU time from each batch's forward to its states encoded (CUDA events; 0 on a CPU)
    )
    gpu_idle_s: float = (
        0.0  # GPU time between batches: the GPU waited for the host (launches, syncs, Python)
    )
    # or, when wait_s is not 0, for the disk
    write_s: float = 0.0  # writer-thread time in write_shard, summed over threads
    max_units_in_memory: int = 0


@dataclasses.dataclass
class _Staging:
    """One host buffer a batch's encoded states are
    copied into: K x [capacity, row] (+ K scales)."""

    raw: torch.Tensor  # uint8, page aligned
    data: list[np.ndarray]  # K x [capacity, row] uint16 | uint8 (views of raw)
    data_t: list[torch.Tensor]  # the same views as tensors (copy targets)
    scales: list[np.ndarray] | None  # K x float32 [capacity] (scaled dtypes only)
    scales_t: list[torch.Tensor] | None
    event: torch.cuda.Event | None  # recorded after the copies into this buffer (GPU only)
    pinned: bool = False


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A sequence of a batch that is kept: the `sample`-th of `assembly`'s unit, `length` tokens,
    at batch row `row`; its states land at staging rows [at, at + length)."""

    assembly: "_Assembly"
    sample: int
    row: int
    length: int
    at: int = 0


class _Assembly:
    """A unit's shard being put together in host memory from the batches its sequences ran in."""

    def __init__(
        self,
        work: UnitWork,
        layers: dict[int, np.ndarray],
        scales: dict[int, np.ndarray] | None,
        dtype: str,
    ):
        self.work = work
        self.layers = layers  # layer id (or FINAL: the final normed state) -> [T, row] stored bits
        self.scales = scales  # layer id -> float32 [T] (scaled dtypes only)
        self.dtype = dtype
        self.missing = work.unit.num_samples

    def place(self, sample: int, staging: _Staging, at: int, layer_ids: Sequence[int]) -> bool:
        """Copy one sequence's rows out of a staging buffer; True once the unit is complete."""
        offsets = self.work.unit.offsets
        a, b = int(offsets[sample]), int(offsets[sample + 1])
        for k, layer_id in enumerate(layer_ids):
            np.copyto(self.layers[layer_id][a:b], staging.data[k][at : at + b - a])
            if self.scales is not None:
                np.copyto(self.scales[layer_id][a:b], staging.scales[k][at : at + b - a])
        self.missing -= 1
        return self.missing == 0

    def payload(self) -> ShardPayload:
        u = self.work.unit
        layers = {
            i: EncodedStates(self.dtype, data, None if self.scales is None else self.scales[i])
            for i, data in self.layers.items()
        }
        final = layers.pop(FINAL, None)
        return ShardPayload(
            input_ids=u.input_ids,
            loss_mask=u.loss_mask,
            offsets=u.offsets,
            sample_ids=u.sample_ids,
            layers=layers,
            final=final,
        )


def sort_window_batches(
    units: Sequence[TokenizedUnit], token_budget: int
) -> list[list[tuple[int, int]]]:
    """A sort window's batches as (unit position in the sort window, sample) pairs
    (precompute/batching.py: sorted by length, longest first, within the token budget). Depends on
    the sort window's content only."""
    seqs = [(u, n) for u, unit in enumerate(units) for n in range(unit.num_samples)]
    lengths = [int(units[u].offsets[n + 1] - units[u].offsets[n]) for u, n in seqs]
    return [[seqs[i] for i in batch] for batch in plan_batches(lengths, token_budget)]


@dataclasses.dataclass
class _Encoded:
    """A submitted batch whose copy to the host is not queued yet: its kept tokens' encoded states
    on the GPU, where they land in the staging buffer, and an event recorded once they are
    encoded."""

    states: list[EncodedStates]
    pieces: list[_Piece]
    tokens: int
    ready: torch.cuda.Event | None


class Pipeline:
    """Staging buffers, the collector thread, the write queue and the writer threads of one rank.

    with Pipeline.start(writer, ...) as pipe:
        assembly = pipe.assembly(work)           # host buffers of a unit to write
        pipe.submit(states, pieces)              # after each forward
    stats = pipe.stats                           # after the with block: all shards written
    """

    # False: each batch's copy is queued as soon as it is encoded, before the next forward; kept so
    # that `benchmarks/precompute.py --copy-order` can time both orders
    copy_after_next_forward = True

    def __init__(
        self,
        writer: StoreWriter,
        layer_ids: list[int],
        device: torch.device,
        staging: list[_Staging],
        writer_threads: int,
        queue_depth: int,
    ):
        self.writer = writer
        self.layer_ids = (
            layer_ids  # the manifest's order (ascending), then FINAL when the store keeps it
        )
        self.dtype = writer.manifest.dtype
        self.hidden = writer.manifest.hidden_size
        self.device = device
        self.capacity = staging[0].data[0].shape[0]
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.staging = staging
        self.free: queue.Queue[_Staging] = queue.Queue()  # staging buffers the GPU may copy into
        self.collect_q: queue.Queue = queue.Queue()  # bounded by the staging buffers in it
        self.write_q: queue.Queue = queue.Queue(maxsize=queue_depth)
        self.writer_threads = writer_threads
        self.stats = PipelineStats()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._in_memory = 0
        self._threads: list[threading.Thread] = []  # the collector, then the writers
        self._pending: _Encoded | None = None  # the last batch submitted, its copy not yet queued

    @classmethod
    def start(
        cls,
        writer: StoreWriter,
        *,
        device: torch.device,
        capacity_tokens: int,
        writer_threads: int,
        queue_depth: int,
    ) -> Pipeline:
        """Allocate (and on a GPU pin) the staging buffers once, start the threads."""
        started, m = time.perf_counter(), writer.manifest
        pin = device.type == "cuda"
        keys = [*m.layer_ids, *([FINAL] if m.final_state else [])]  # what a batch's states hold
        with ThreadPoolExecutor(
            STAGING_BUFFERS
        ) as pool:  # pinning faults every page in: in parallel
            staging = list(
                pool.map(
                    lambda _: _allocate_staging(
                        len(keys), m.hidden_size, m.dtype, capacity_tokens, pin, device
                    ),
                    range(STAGING_BUFFERS),
                )
            )
        pipe = cls(writer, keys, device, staging, writer_threads, queue_depth)
        for s in staging:
            pipe.free.put(s)
        pipe._threads = [threading.Thread(target=pipe._collect, name="dflash-collect", daemon=True)]
        pipe._threads += [
            threading.Thread(target=pipe._write, name=f"dflash-write-{i}", daemon=True)
            for i in range(writer_threads)
        ]
        for t in pipe._threads:
            t.start()
        pipe.stats.setup_s = time.perf_counter() - started
        return pipe

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=exc_type is not None)

    # -- main thread --------------------------------------------------------------------------

    def assembly(self, work: UnitWork) -> _Assembly:
        """Host buffers for a unit to write (pages are touched only when states land in them)."""
        t, np_dtype = work.unit.num_tokens, storage_numpy_dtype(self.dtype)
        layers = {
            i: np.empty((t, row_size(self.dtype, self.hidden)), np_dtype) for i in self.layer_ids
        }
        scales = (
            {i: np.empty(t, np.float32) for i in self.layer_ids} if has_scale(self.dtype) else None
        )
        with self._lock:
            self._in_memory += 1
            self.stats.max_units_in_memory = max(self.stats.max_units_in_memory, self._in_memory)
        return _Assembly(work, layers, scales, self.dtype)

    def submit(
        self,
        states: dict[int, torch.Tensor],
        pieces: list[_Piece],
        on_encoded: Callable[[], None] = lambda: None,
    ) -> None:
        """Hand over one batch: states {layer id (and FINAL): [B, S, H]} and the sequences to keep,
        right after its forward was launched. Queues the copy of the batch before (see the module
        docstring), then encodes this one; its copy waits for the next submit or close. Blocks only
        when no staging buffer is free, i.e. when the collector or the disk is behind. `on_encoded`
        is called once the batch's GPU work is queued (the GPU clock's end of the batch)."""
        self.raise_if_failed()
        self._flush()
        if not pieces:
            on_encoded()
            return
        placed, at = [], 0
        for p in pieces:
            placed.append(dataclasses.replace(p, at=at))
            at += p.length
        if at > self.capacity:  # the config keeps token_budget >= max_length, so never
            raise ValueError(
                f"a batch keeps {at} tokens, more than the staging buffers' {self.capacity}"
            )
        self._pending = _Encoded(self._encode(states, placed), placed, at, _recorded(self.device))
        on_encoded()
        if not self.copy_after_next_forward:
            self._flush()

    def _flush(self) -> None:
        """Queue the pending batch's copy into a free
        staging buffer and hand it to the collector."""
        batch, self._pending = self._pending, None
        if batch is None:
            return
        started = time.perf_counter()
        staging = self._get(self.free)
        self.stats.wait_s += time.perf_counter() - started
        if staging is None:
            self.raise_if_failed()
            raise RuntimeError("the pipeline was stopped")
        self._copy_out(batch, staging)
        self.collect_q.put((staging, batch.pieces))

    def _encode(self, states: dict[int, torch.Tensor], pieces: list[_Piece]) -> list[EncodedStates]:
        """The kept tokens of every layer, gathered and encoded on the compute stream."""
        first = states[self.layer_ids[0]]
        seq_len = first.shape[1]
        rows = np.concatenate([p.row * seq_len + np.arange(p.length) for p in pieces])
        index = to_device(torch.from_numpy(rows), first.device)  # [T] positions in [B*S]
        return [
            encode_states(
                states[i].reshape(-1, self.hidden).index_select(0, index), self.dtype
            )  # [T, H]
            for i in self.layer_ids
        ]

    def _copy_out(self, batch: _Encoded, staging: _Staging) -> None:
        """Copy a batch's encoded states into `staging` (on a GPU: on the copy stream, once they are
        encoded, then the staging buffer's event)."""
        if self.copy_stream is None:
            self._copy_all(batch.states, staging, batch.tokens)
            return
        self.copy_stream.wait_event(
            batch.ready
        )  # not wait_stream: the next forward is queued since
        with torch.cuda.stream(self.copy_stream):
            self._copy_all(batch.states, staging, batch.tokens)
            staging.event.record(self.copy_stream)
        for enc in batch.states:  # allocated on the compute stream, read by the copy stream
            enc.data.record_stream(self.copy_stream)
            if enc.scale is not None:
                enc.scale.record_stream(self.copy_stream)

    @staticmethod
    def _copy_all(encoded: list[EncodedStates], staging: _Staging, tokens: int) -> None:
        for k, enc in enumerate(encoded):
            staging.data_t[k][:tokens].copy_(enc.data, non_blocking=True)
            if staging.scales_t is not None:
                staging.scales_t[k][:tokens].copy_(enc.scale, non_blocking=True)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self, abort: bool = False) -> None:
        """Normally: copy the last batch out and wait until every queued unit is written. `abort`:
        stop at once (units not yet published are simply computed again by the next run).
        Re-raises a thread's error."""
        failure = None
        if not abort:
            try:
                self._flush()
            except BaseException as e:  # noqa: BLE001 - raised once the threads are stopped
                failure, abort = e, True
        self._pending = None
        if abort:
            self._stop.set()
        self.collect_q.put(None)
        self._threads[0].join()
        for _ in self._threads[1:]:
            self._put(self.write_q, None)
        for t in self._threads[1:]:
            t.join()
        if self.copy_stream is not None:
            # no copy may still land in a buffer about to be unpinned
            self.copy_stream.synchronize()
        for s in self.staging:
            _release_staging(s)
        if failure is not None:
            self.raise_if_failed()  # a thread's error explains the failed copy best
            raise failure
        if not abort:
            self.raise_if_failed()

    # -- collector and writer threads ----------------------------------------------------------

    def _collect(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(
                self.device
            )  # per thread: else CUDA calls here open a context on GPU 0
        while (item := self.collect_q.get()) is not None:
            staging, pieces = item
            try:
                if staging.event is not None:
                    staging.event.synchronize()  # releases the GIL while the copy finishes
                if not self._stop.is_set():
                    self._place(staging, pieces)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self._fail(e)
            finally:
                self.free.put(staging)

    def _place(self, staging: _Staging, pieces: list[_Piece]) -> None:
        for p in pieces:
            if p.assembly.place(p.sample, staging, p.at, self.layer_ids) and not self._put(
                self.write_q, p.assembly
            ):
                return

    def _write(self) -> None:
        while (assembly := self._get(self.write_q)) is not None:
            try:
                if not self._stop.is_set():
                    self._write_one(assembly)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self._fail(e, shard=assembly.work.name)
            finally:
                with self._lock:
                    self._in_memory -= 1

    def _write_one(self, assembly: _Assembly) -> None:
        started = time.perf_counter()
        name = assembly.work.name
        published = self.writer.write_shard(name, assembly.payload()).published
        nbytes = _tree_bytes(self.writer.path / SHARDS_DIR / name) if published else 0
        with self._lock:
            self.stats.write_s += time.perf_counter() - started
            self.stats.units_written += 1 if published else 0
            self.stats.units_published_elsewhere += 0 if published else 1
            self.stats.bytes_written += nbytes

    def _fail(self, error: BaseException, shard: str | None = None) -> None:
        with self._lock:
            if self.error is None:
                self.error = _as_user_error(error, shard)
        self._stop.set()

    def _get(self, q: queue.Queue):
        """q.get(), or None once another thread failed."""
        while True:
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return None

    def _put(self, q: queue.Queue, item) -> bool:
        """q.put(item) (blocking while q is full); False once another thread failed."""
        while not self._stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                pass
        return item is None and _put_nowait(q)


def _put_nowait(q: queue.Queue) -> bool:
    try:
        q.put_nowait(None)
        return True
    except queue.Full:
        return False


def _as_user_error(error: BaseException, shard: str | None) -> BaseException:
    """Errors a user acts on get the sentence that says what happens next (`shard`: the one being
    written when the error came, if any)."""
    resume = (
        "shards published so far are kept, and rerunning the same command resumes after the fix."
    )
    if isinstance(error, NonFiniteStatesError):
        return NonFiniteStatesError(f"{error} The run stopped; {resume}", error.sample_id)
    if isinstance(error, UserError):
        return UserError(f"{error} The run stopped; {resume}")
    if is_disk_full(
        error
    ):  # the failed shard's staging dir is already removed (StoreWriter.write_shard)
        where = f" while writing shard {shard}" if shard else ""
        return UserError(
            f"the store's filesystem is full{where} ({os_reason(error)}); free space (or choose "
            f"store.dtype = 'fp8_e4m3'); nothing of that shard is visible, {resume}"
        )
    return error


def _tree_bytes(path: os.PathLike) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(os.stat(os.path.join(dirpath, f)).st_size for f in files)
    return total


def _allocate_staging(
    layers: int, hidden: int, dtype: str, capacity: int, pin: bool, device: torch.device
) -> _Staging:
    """One page-aligned host buffer: per layer [capacity,
    row] stored bits (+ float32 [capacity] scales)."""
    item, row = storage_numpy_dtype(dtype), row_size(dtype, hidden)
    scaled = has_scale(dtype)
    region = _page_aligned(capacity * row * item.itemsize)
    scale_region = _page_aligned(capacity * 4) if scaled else 0
    total = layers * (region + scale_region)
    backing = torch.empty(total + _PAGE, dtype=torch.uint8)
    start = -backing.data_ptr() % _PAGE  # malloc aligns to 64 bytes, registration pins whole pages
    raw = backing[start : start + total]
    data_t, scales_t = [], []
    for k in range(layers):
        base = k * (region + scale_region)
        data_t.append(
            raw[base : base + capacity * row * item.itemsize]
            .view(storage_torch_dtype(dtype))
            .view(capacity, row)
        )
        if scaled:
            scales_t.append(raw[base + region : base + region + capacity * 4].view(torch.float32))
    staging = _Staging(
        raw,
        [t.numpy() for t in data_t],
        data_t,
        [t.numpy() for t in scales_t] if scaled else None,
        scales_t if scaled else None,
        _event(device),
    )
    if pin:
        torch.cuda.set_device(device)  # this is a pool thread: its CUDA calls go to GPU 0 otherwise
        err = int(
            torch.cuda.cudart().cudaHostRegister(
                raw.data_ptr(), total, _CUDA_HOST_REGISTER_PORTABLE
            )
        )
        if err != 0:
            raise RuntimeError(f"pinning a {total}-byte staging buffer failed (cudaError {err})")
        staging.pinned = True
    return staging


def _recorded(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded now on the current (compute) stream; None on a CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _event(device: torch.device) -> torch.cuda.Event | None:
    # blocking: the collector sleeps in synchronize() instead of spinning a core the writers need
    return torch.cuda.Event(blocking=True) if device.type == "cuda" else None


def _release_staging(staging: _Staging) -> None:
    if staging.pinned:
        torch.cuda.cudart().cudaHostUnregister(staging.raw.data_ptr())
        staging.pinned = False


def _page_aligned(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, queued without waiting for the GPU. From pageable memory CUDA
    first synchronises the stream (the previous batch's forward must finish before the copy starts),
    so the GPU's queue would run empty at every batch and idle while the host launched the next
    forward;
    from pinned memory (torch's caching host allocator, which keeps the block until the copy is
    done) the copy is queued behind that work like any kernel."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class GpuClock:
    """CUDA events before and after each batch's work on the compute stream (its forward, then the
    gather and encoding of its states): how long the GPU ran the batches, and how long it stood idle
    between them waiting for the host. A wait for the disk falls between batches too; the pipeline
    counts it apart (`PipelineStats.wait_s`). Reading the events at the end costs one
    synchronisation; nothing on a CPU."""

    def __init__(self, device: torch.device):
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = (
            [] if device.type == "cuda" else None
        )
        self._start: torch.cuda.Event | None = None

    def start(self) -> None:
        if self.marks is not None:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def stop(self) -> None:
        if self.marks is not None and self._start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.marks.append((self._start, end))
            self._start = None

    def add_to(self, stats: PipelineStats) -> None:
        if not self.marks:
            return
        self.marks[-1][1].synchronize()
        busy = sum(start.elapsed_time(end) for start, end in self.marks) / 1e3
        span = self.marks[0][0].elapsed_time(self.marks[-1][1]) / 1e3
        stats.gpu_busy_s += busy
        stats.gpu_idle_s += max(0.0, span - busy)


def run_sort_windows(
    target,
    sort_windows: Iterable[list[UnitWork]],
    pipe: Pipeline,
    token_budget: int,
    on_batch: Callable[[int, int], None] = lambda sequences, tokens: None,
) -> None:
    """Forward every sort window's batches through `target` (a CapturedTarget) into `pipe`. Units
    with a name are assembled and written; the others only run (so the batches match a full run)."""
    device, clock = target.device, GpuClock(target.device)
    with torch.inference_mode():
        for sort_window in sort_windows:
            units = [w.unit for w in sort_window]
            assemblies = {
                u: pipe.assembly(w) for u, w in enumerate(sort_window) if w.name is not None
            }
            for batch in sort_window_batches(units, token_budget):
                seqs = [
                    units[u].input_ids[units[u].offsets[n] : units[u].offsets[n + 1]]
                    for u, n in batch
                ]
                ids = to_device(pad_right(seqs, pad_id=0), device)  # [B, S]; pads are never kept
                pieces = [
                    _Piece(assemblies[u], n, row, len(seqs[row]))
                    for row, (u, n) in enumerate(batch)
                    if u in assemblies
                ]
                clock.start()
                pipe.submit(
                    _forward(target, ids, token_budget), pieces, clock.stop
                )  # the states live no longer
                _count(pipe.stats, seqs, ids)
                on_batch(len(seqs), sum(len(s) for s in seqs))
    clock.add_to(pipe.stats)


def _forward(target, ids: torch.Tensor, token_budget: int) -> dict[int | str, torch.Tensor]:
    try:
        return dict(zip(target.state_keys, target.forward(ids)))
    except torch.OutOfMemoryError as e:
        raise UserError(
            f"the target's forward ran out of GPU memory on a batch of {ids.shape[0]} x "
            f"{ids.shape[1]} tokens; lower batching.token_budget (now {token_budget})."
        ) from e


def _count(stats: PipelineStats, seqs: list[np.ndarray], ids: torch.Tensor) -> None:
    stats.batches += 1
    stats.sequences += len(seqs)
    stats.tokens += sum(len(s) for s in seqs)
    stats.padded_tokens += ids.numel()
