"""The shard cache: a slab of fixed-size host-memory slots, filled from disk by reader threads ahead
of need, and recycled least-recently-used first.

Pinned memory is allocated ONCE at start-up as one tensor (pinning is slow, and torch's pinned host
allocator rounds every request up to a power of two: 100 GB would pin 128 GB). The tensor is carved
into equal slots that are views of it; a shard takes `slots_per_entry` of them (the trainer uses one
slot per target layer, sized for the largest shard: see train/data.py `slot_layout`). Without CUDA
the slab is ordinary memory (there is nothing to pin for), and the log says so.

    cache = ShardCache(SlotSlab.allocate(n_slots, slot_bytes), slots_per_entry=K, read_fn=..., threads=4)
    handle = cache.request(key)     # never blocks: a miss is queued for the readers
    data = handle.wait()            # blocks until the shard is in its slots
    ...                             # copies out of the slots (possibly asynchronous)
    handle.release()                # after the copies finished: the slots may be reused

An entry is never evicted while a handle on it is held, so a host->device copy in flight out of its
slots cannot be overwritten. Entries are claimed in request order, so a shard requested later can
never take the slots a shard requested earlier is waiting for.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Hashable

import torch

from dflash_common.fsutil import human_bytes

log = logging.getLogger("dflash")

# Pin slot by slot on this many threads: registering memory faults every page in, which is the slow
# part and parallelises; a copy never spans two slots, so per-slot registrations are enough.
_PIN_THREADS = 8
# Slots start and end on page boundaries: the driver pins whole pages, and two registrations may not
# share one (the second would fail as already registered).
PAGE = 4096


class SlotSlab:
    """`n_slots` equal slots of `slot_bytes`, views of one allocation (pinned when CUDA is present)."""

    def __init__(self, buffer: torch.Tensor, slot_bytes: int, pinned: bool):
        self.buffer = buffer  # uint8 [n_slots * slot_bytes]
        self.slot_bytes = slot_bytes
        self.n_slots = buffer.numel() // slot_bytes
        self.pinned = pinned

    @classmethod
    def allocate(cls, n_slots: int, slot_bytes: int, pin: bool | None = None) -> "SlotSlab":
        """One allocation of `n_slots` page-aligned slots of at least `slot_bytes`; pinned by default
        when CUDA is present."""
        if n_slots < 1 or slot_bytes < 1:
            raise ValueError(f"a slab needs at least one slot of at least one byte, got {n_slots} x {slot_bytes}")
        pin = torch.cuda.is_available() if pin is None else pin
        slot_bytes = -(-slot_bytes // PAGE) * PAGE
        raw = torch.empty(n_slots * slot_bytes + PAGE, dtype=torch.uint8)  # malloc aligns to 64 bytes, not pages
        start = -raw.data_ptr() % PAGE
        slab = cls(raw[start:start + n_slots * slot_bytes], slot_bytes, pinned=False)
        if pin:
            started = time.perf_counter()
            slab._register()
            log.info("shard cache: pinned %s in %.1f s", human_bytes(n_slots * slot_bytes),
                     time.perf_counter() - started)
        else:
            why = "no CUDA: nothing to copy to" if not torch.cuda.is_available() else "pinning turned off"
            log.info("shard cache: %s of ordinary memory, not pinned (%s)", human_bytes(n_slots * slot_bytes), why)
        return slab

    def _register(self) -> None:
        cudart = torch.cuda.cudart()
        device = torch.cuda.current_device()  # this rank's GPU; a new thread starts on GPU 0

        def pin(i: int) -> None:
            torch.cuda.set_device(device)  # else every rank's pin threads make a CUDA context on GPU 0
            ptr = self.buffer.data_ptr() + i * self.slot_bytes
            err = int(cudart.cudaHostRegister(ptr, self.slot_bytes, 1))  # 1: cudaHostRegisterPortable
            if err != 0:
                raise RuntimeError(f"pinning {self.slot_bytes} bytes of the shard cache failed (cudaError {err})")

        with ThreadPoolExecutor(_PIN_THREADS) as pool:
            list(pool.map(pin, range(self.n_slots)))
        self.pinned = True

    def view(self, i: int) -> torch.Tensor:
        return self.buffer[i * self.slot_bytes:(i + 1) * self.slot_bytes]  # uint8 [slot_bytes]

    def close(self) -> None:
        """Unpin (the caller guarantees no copy out of the slab is still in flight)."""
        if self.pinned:
            cudart = torch.cuda.cudart()
            for i in range(self.n_slots):
                cudart.cudaHostUnregister(self.buffer.data_ptr() + i * self.slot_bytes)
            self.pinned = False


@dataclasses.dataclass
class CacheStats:
    hits: int = 0  # counted requests that found their shard already read
    misses: int = 0  # counted requests that had to wait for a read (queued or in progress)
    bytes_read: int = 0
    read_s: float = 0.0  # reader-thread time spent in read_fn, summed over threads
    wait_s: float = 0.0  # time callers spent blocked in Handle.wait

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class _Entry:
    def __init__(self, key: Hashable):
        self.key = key
        self.slots: list[int] = []
        self.refs = 0
        self.data: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class Handle:
    """A reference on one cached shard: its slots stay untouched until `release()`."""

    def __init__(self, cache: "ShardCache", entry: _Entry):
        self._cache = cache
        self._entry = entry
        self._released = False

    @property
    def key(self) -> Hashable:
        return self._entry.key

    def wait(self) -> Any:
        """The shard's data as returned by the cache's read_fn (views of its slots); blocks until read."""
        if not self._entry.done.is_set():
            started = time.perf_counter()
            self._entry.done.wait()
            with self._cache._lock:
                self._cache.stats.wait_s += time.perf_counter() - started
        if self._entry.error is not None:
            raise self._entry.error
        return self._entry.data

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._cache._release(self._entry)

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


ReadFn = Callable[[Hashable, list[torch.Tensor]], tuple[Any, int]]


class ShardCache:
    """LRU cache of shards in a slab's slots. `read_fn(key, slot_views) -> (data, bytes_read)` fills
    the given uint8 slot views (and may return views of them); it runs on the reader threads."""

    def __init__(self, slab: SlotSlab, slots_per_entry: int, read_fn: ReadFn, threads: int):
        if slots_per_entry > slab.n_slots:
            raise ValueError(f"a shard needs {slots_per_entry} slots but the cache has {slab.n_slots}")
        self.slab = slab
        self.slots_per_entry = slots_per_entry
        self.read_fn = read_fn
        self.stats = CacheStats()
        self._lock = threading.Condition()
        self._entries: dict[Hashable, _Entry] = {}
        self._evictable: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()  # LRU first
        self._pending: collections.deque[_Entry] = collections.deque()  # waiting for slots, in request order
        self._free = list(range(slab.n_slots))
        self._closed = False
        self._threads = [threading.Thread(target=self._reader, name=f"shard-reader-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    @property
    def capacity(self) -> int:
        """Shards that fit at once."""
        return self.slab.n_slots // self.slots_per_entry

    def request(self, key: Hashable, count: bool = True) -> Handle:
        """A handle on `key`; an absent shard is queued for the reader threads. Never blocks.

        Requests that will be waited on now count as hits or misses; prefetch requests pass
        count=False, so the hit rate says how often a batch found its shards already read."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the shard cache is closed")
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(key)
                self._pending.append(entry)
                self._lock.notify_all()
            else:
                self._evictable.pop(key, None)
            if count:
                if entry.done.is_set():
                    self.stats.hits += 1
                else:
                    self.stats.misses += 1
            entry.refs += 1
            return Handle(self, entry)

    def resident(self) -> list[Hashable]:
        with self._lock:
            return [k for k, e in self._entries.items() if e.done.is_set() and e.error is None]

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.refs -= 1
            if entry.refs == 0 and entry.done.is_set() and self._entries.get(entry.key) is entry:
                self._evictable[entry.key] = entry  # most recently used last
                self._lock.notify_all()

    def _claim_slots(self) -> _Entry | None:
        """Under the lock: wait until the oldest pending shard can have slots (evicting LRU), take it."""
        while not self._closed:
            if self._pending:
                while len(self._free) < self.slots_per_entry and self._evictable:
                    _, victim = self._evictable.popitem(last=False)
                    del self._entries[victim.key]
                    self._free.extend(victim.slots)
                if len(self._free) >= self.slots_per_entry:
                    entry = self._pending.popleft()
                    entry.slots = [self._free.pop() for _ in range(self.slots_per_entry)]
                    return entry
            self._lock.wait()
        return None

    def _reader(self) -> None:
        while True:
            with self._lock:
                entry = self._claim_slots()
            if entry is None:
                return
            started = time.perf_counter()
            try:
                data, nbytes = self.read_fn(entry.key, [self.slab.view(i) for i in entry.slots])
            except BaseException as e:  # handed to the waiter, which raises it in its own thread
                self._finish(entry, None, 0, started, e)
            else:
                self._finish(entry, data, nbytes, started, None)

    def _finish(self, entry: _Entry, data: Any, nbytes: int, started: float, error: BaseException | None) -> None:
        with self._lock:
            entry.data, entry.error = data, error
            self.stats.read_s += time.perf_counter() - started
            self.stats.bytes_read += nbytes
            if error is not None:  # forget it, so a later request reads again
                del self._entries[entry.key]
                self._free.extend(entry.slots)
            elif entry.refs == 0:
                self._evictable[entry.key] = entry
            entry.done.set()
            self._lock.notify_all()

    def close(self) -> None:
        """Stop the readers (a read in progress finishes first). The slab stays allocated."""
        with self._lock:
            self._closed = True
            for entry in self._pending:
                entry.error = RuntimeError("the shard cache was closed before this shard was read")
                entry.done.set()
            self._pending.clear()
            self._lock.notify_all()
        for t in self._threads:
            t.join()
