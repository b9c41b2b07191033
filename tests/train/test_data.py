"""The data path on real stores: slots filled straight from zarr with only the chosen layers, device
batches equal to the store's states in the drafter's layer order (bf16, fp8 and q4_hadamard), a
checkpointable position that replays the same batches and anchors, and several stores mixed (also of
different storage dtypes in one batch)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_common.config import load_config
from dflash_common.drafter.objective import AcceptanceCounts, sample_anchors
from dflash_common.store import Store
from train.config import TrainConfig
from train.data import TrainData, allocate_cache, scan_stores, seeded_generator
from train.objective import block_counts

from train_helpers import write_tiny_store


def _cfg(store, *overrides):
    base = ["--data.cache_gb=0.01", "--data.batch_tokens=512", "--data.window_shards=2", "--data.holdout_sequences=4",
            "--drafter.block_size=4", "--objective.max_anchors=8", "--precision.autocast=none"]
    return load_config(TrainConfig, None, [f"--data.stores=[\"{store}\"]", *base, *overrides])


def _check_batches(store: Store | list[Store], data: TrainData, feeder, layer_ids, n: int) -> set[frozenset]:
    """n device batches equal the stores' states read the plain way (whole shard, decode, slice);
    returns the sets of storage dtypes the batches held."""
    stores = store if isinstance(store, list) else [store]
    seen = set()
    for _ in range(n):
        batch = next(feeder)
        rows = data.plan.epoch(batch.epoch, 0).batches[batch.index]  # [n, 3] (shard, sequence, tokens)
        expected, ids = [], []
        seen.add(frozenset(stores[data.plan.shards[shard].store].manifest.dtype for shard in rows[:, 0].tolist()))
        for shard, seq, k in rows.tolist():
            meta = data.plan.shards[shard]
            d = stores[meta.store].read_shard(meta.name)
            src = int(d.offsets[seq])
            expected.append(torch.cat([d.states(i, out_dtype=torch.float32)[src:src + k] for i in layer_ids], -1))
            ids.append(torch.from_numpy(d.input_ids[src:src + k].astype(np.int64)))
        assert torch.equal(batch.features.float().cpu(), torch.cat(expected))  # [T, K*H], bit for bit
        assert torch.equal(batch.input_ids.cpu(), torch.cat(ids))
        assert batch.features.shape[1] == len(layer_ids) * stores[0].manifest.hidden_size
        assert batch.anchors.numel() > 0 and batch.cu_seqlens[-1] == batch.tokens
    return seen


@pytest.mark.parametrize("fixture", ["tiny_store", "tiny_store_fp8", "tiny_store_q4"])
def test_device_batches_equal_the_stores_states_in_layer_order(fixture, request):
    path = request.getfixturevalue(fixture)
    layer_ids = [5, 1, 3]  # not sorted: the drafter's order must be kept
    store = Store.open(path)
    data = TrainData.build(_cfg(path), [store], layer_ids, rank=0, world=1, device=torch.device("cpu"))
    _check_batches(store, data, data.start(), layer_ids, 3)
    cache = data.node.cache
    resident = cache.resident()  # the cache holds every shard here: nothing was evicted
    assert cache.stats.bytes_read == sum(s.nbytes for k in resident
                                         for s in store.buffer_specs(data.plan.shards[k].name, layer_ids).values())
    data.close()
    store.close()


def _two_slot_cfg(store: Store, path):
    biggest = max(store.shard_nbytes(i.name, [2, 4]) for i in store.shards)
    return _cfg(path, "--data.window_shards=1", f"--data.cache_gb={2.5 * biggest / 1e9}", "--data.batch_tokens=700")


def test_a_cache_of_two_slots_evicts_and_still_serves_every_batch_right(tiny_store):
    store = Store.open(tiny_store)
    data = TrainData.build(_two_slot_cfg(store, tiny_store), [store], [2, 4], rank=0, world=1,
                           device=torch.device("cpu"))
    assert data.cache.capacity == 2
    _check_batches(store, data, data.start(), [2, 4], 14)  # more than an epoch: every shard read twice
    assert data.cache.stats.bytes_read > sum(s.nbytes for i in store.shards
                                             for s in store.buffer_specs(i.name, [2, 4]).values())
    data.close()
    store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["tiny_store", "tiny_store_fp8"])
def test_on_the_gpu_copies_in_flight_never_see_a_reused_slot(fixture, request):
    """Side-stream copies out of pinned slots, two slots for the whole store: a slot reused while a
    copy out of it is in flight would show up as a batch that differs from the store."""
    path = request.getfixturevalue(fixture)
    store = Store.open(path)
    data = TrainData.build(_two_slot_cfg(store, path), [store], [2, 4], rank=0, world=1,
                           device=torch.device("cuda"))
    assert data.cache.slab.pinned and data.gpu_prefetch == 1
    _check_batches(store, data, data.start(), [2, 4], 14)
    data.close()
    store.close()


def test_only_the_chosen_layers_are_read(tiny_store):
    store = Store.open(tiny_store)
    shards = scan_stores([store], 2, 512)
    cache = allocate_cache([store], shards, [2], cache_gb=0.01, min_shards=1, threads=1, what="test")
    with cache.request(0) as h:
        slot = h.wait()
    specs = store.buffer_specs(shards[0].name, [2])
    assert len(slot.states) == 1 and cache.stats.bytes_read == sum(s.nbytes for s in specs.values())
    assert store.shard_nbytes(shards[0].name, [2]) * 3 < store.shard_nbytes(shards[0].name)
    cache.close()
    store.close()


def _take(feeder, n):
    return [(b.epoch, b.index, b.input_ids.clone(), b.anchors.clone(), b.position) for b in
            (next(feeder) for _ in range(n))]


def test_the_position_replays_the_same_batches_and_anchors(tiny_store):
    store = Store.open(tiny_store)
    cfg = _cfg(tiny_store, "--data.batch_tokens=1024")
    first = TrainData.build(cfg, [store], [1, 2], rank=0, world=1, device=torch.device("cpu"))
    straight = _take(first.start(), 12)
    epochs = {e for e, *_ in straight}
    assert len(epochs) >= 2, "the test should cross an epoch boundary"
    first.close()
    k = 5
    again = TrainData.build(cfg, [store], [1, 2], rank=0, world=1, device=torch.device("cpu"))
    resumed = _take(again.start(straight[k - 1][4]), 12 - k)
    again.close()
    for a, b in zip(straight[k:], resumed):
        assert a[:2] == b[:2] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    store.close()


def test_anchors_are_redrawn_every_epoch_and_fixed_by_the_seed():
    mask = torch.ones(400, dtype=torch.bool)
    cu = torch.tensor([0, 150, 400])

    def anchors(seed, epoch):
        return sample_anchors(mask, cu, 8, 16, seeded_generator(seed, 11, epoch, 0, 0))

    assert torch.equal(anchors(0, 0), anchors(0, 0))
    assert not torch.equal(anchors(0, 0), anchors(0, 1)) and not torch.equal(anchors(0, 0), anchors(1, 0))


def test_stores_are_mixed_and_held_out_sequences_never_trained(tiny_store, tiny_target, tmp_path):
    other = write_tiny_store(tmp_path / "other", tiny_target, n_shards=2, per_shard=6, first_record=80)
    stores = [Store.open(tiny_store), Store.open(other)]
    cfg = load_config(TrainConfig, None, [
        f"--data.stores=[\"{tiny_store}\", \"{other}\"]", "--data.weights=[1.0, 1.0]", "--data.cache_gb=0.01",
        "--data.batch_tokens=512", "--data.window_shards=2", "--data.holdout_sequences=3",
        "--drafter.block_size=4", "--precision.autocast=none"])
    data = TrainData.build(cfg, stores, [1], rank=0, world=1, device=torch.device("cpu"))
    plan = data.plan
    order = plan.epoch_shards(0)
    tokens = [sum(plan.train_tokens(i) for i in order if plan.shards[i].store == s) for s in (0, 1)]
    assert abs(tokens[0] - tokens[1]) / sum(tokens) < 0.25  # equal weights: about half each
    held = {(s, q) for s, v in enumerate(plan.split.val) for q in v.tolist()}
    assert len(held) == 6  # 3 per store
    trained = {(s, q) for b in plan.epoch(0, 0).batches for s, q in b[:, :2].tolist()}
    assert not held & trained
    val = list(data.val_batches())
    assert sum(b.cu_seqlens.numel() - 1 for b in val) == 6
    data.close()
    for s in stores:
        s.close()


def test_stores_of_different_dtypes_share_batches_and_decode_each_in_place(tiny_store_fp8, tiny_store_q4, tiny_store):
    """bf16, fp8 and q4_hadamard shards in one batch: each row is decoded by its own store's dtype and
    lands at its place in the batch."""
    paths = [tiny_store, tiny_store_fp8, tiny_store_q4]
    stores = [Store.open(p) for p in paths]
    cfg = load_config(TrainConfig, None, [
        f"--data.stores={json.dumps([str(p) for p in paths])}", "--data.cache_gb=0.05", "--data.batch_tokens=900",
        "--data.window_shards=4", "--data.holdout_sequences=0", "--drafter.block_size=4", "--precision.autocast=none"])
    data = TrainData.build(cfg, stores, [4, 2], rank=0, world=1, device=torch.device("cpu"))
    seen = _check_batches(stores, data, data.start(), [4, 2], 8)
    assert max(len(s) for s in seen) >= 2, seen  # some batch mixed dtypes
    data.close()
    for s in stores:
        s.close()


def test_block_counts_match_acceptance_counts():
    g = torch.Generator().manual_seed(0)
    correct = torch.rand(50, 8, generator=g) < 0.7
    valid = torch.rand(50, 8, generator=g) < 0.9
    valid[:, 0] = False
    valid[3] = False  # a block with no valid prediction
    ours = AcceptanceCounts.from_tensor(block_counts(correct, valid))
    ref = AcceptanceCounts.from_blocks(correct, valid)
    assert torch.equal(ours.correct, ref.correct) and torch.equal(ours.valid, ref.valid)
    assert (ours.accepted, ours.blocks) == (ref.accepted, ref.blocks)
