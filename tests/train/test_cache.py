"""The slot cache's policy: hits and misses, LRU eviction, never evicting what is referenced,
request-order claims, read errors reaching the waiter. (Reading real stores:
tests/train/test_data.py.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from train.cache import ShardCache, SlotSlab


def _filler(log, delay=0.0, fail=()):
    def read(key, views):
        if delay:
            time.sleep(delay)
        if key in fail:
            raise OSError(f"cannot read {key}")
        for v in views:
            v.fill_(key % 256)
        log.append(key)
        return views, sum(v.numel() for v in views)

    return read


def _cache(n_slots, per_entry=2, threads=2, **kw):
    reads = []
    slab = SlotSlab.allocate(n_slots, 16, pin=False)
    return ShardCache(slab, per_entry, _filler(reads, **kw), threads), reads


def test_slots_are_page_aligned_views_of_one_allocation():
    slab = SlotSlab.allocate(4, 5000, pin=False)
    assert slab.slot_bytes == 8192 and slab.n_slots == 4
    slab.buffer.zero_()
    slab.view(2).fill_(7)
    assert slab.buffer[2 * 8192 : 3 * 8192].eq(7).all() and slab.buffer[: 2 * 8192].eq(0).all()
    assert all(slab.view(i).data_ptr() % 4096 == 0 for i in range(4))
    assert slab.view(3).untyped_storage().data_ptr() == slab.view(0).untyped_storage().data_ptr()


@pytest.mark.gpu
def test_pinned_slots_copy_to_the_gpu_without_blocking():
    slab = SlotSlab.allocate(3, 10_000, pin=True)  # odd size: slots still own whole pages
    # Tensor.is_pinned() looks at the storage's base pointer, which lies before the page-aligned
    # slots and is not registered; the driver's own answer: each slot is a registration of its own,
    # so unregistering it succeeds (and it is registered again). A failing call would leave a sticky
    # CUDA error behind, hence no probe that is expected to fail.
    cudart = torch.cuda.cudart()
    assert slab.pinned
    for i in range(3):
        assert int(cudart.cudaHostUnregister(slab.view(i).data_ptr())) == 0
        assert int(cudart.cudaHostRegister(slab.view(i).data_ptr(), slab.slot_bytes, 1)) == 0
    slab.view(1).fill_(5)
    dev = slab.view(1).to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert dev.eq(5).all()
    slab.close()
    assert not slab.pinned


def test_hits_misses_bytes_and_contents():
    cache, reads = _cache(4)
    with cache.request(1) as h:
        views = h.wait()
        assert [int(v[0]) for v in views] == [1, 1]
    with cache.request(1) as h:
        h.wait()
    assert (cache.stats.hits, cache.stats.misses, cache.stats.bytes_read) == (
        1,
        1,
        2 * cache.slab.slot_bytes,
    )
    assert reads == [1]
    cache.close()


def test_least_recently_used_is_evicted_first():
    cache, reads = _cache(4)  # two shards fit
    for key in (1, 2, 1, 3):  # 2 is now least recently used
        with cache.request(key) as h:
            h.wait()
    assert sorted(cache.resident()) == [1, 3]
    cache.close()


def test_a_referenced_shard_is_never_evicted_and_later_requests_wait():
    cache, reads = _cache(4)
    h1, h2 = cache.request(1), cache.request(2)
    h1.wait(), h2.wait()
    h3 = cache.request(3)  # no free slots, nothing evictable: must wait
    time.sleep(0.05)
    assert reads == [1, 2] or reads == [2, 1]
    assert not h3._entry.done.is_set()
    before = h1.wait()[0].clone()
    h2.release()
    h3.wait()
    assert torch.equal(h1.wait()[0], before) and sorted(cache.resident()) == [1, 3]
    h1.release(), h3.release()
    cache.close()


def test_claims_follow_request_order():
    cache, reads = _cache(1, per_entry=1, threads=4, delay=0.01)  # one slot: reads are serial
    handles = [cache.request(k) for k in range(6)]
    for h in handles:
        h.wait()
        h.release()
    assert reads == list(range(6))
    cache.close()


def test_a_failed_read_reaches_the_waiter_and_is_retried():
    cache, reads = _cache(4, fail={5})
    with cache.request(5) as h, pytest.raises(OSError, match="cannot read 5"):
        h.wait()
    assert 5 not in cache.resident() and len(cache._free) == 4
    cache.close()


def test_close_wakes_waiters():
    cache, _ = _cache(2)
    h1 = cache.request(1)
    h1.wait()
    h2 = cache.request(2)
    threading.Timer(0.05, cache.close).start()
    with pytest.raises(RuntimeError, match="closed"):
        h2.wait()
