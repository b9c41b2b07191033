"""The batch plan: every training sequence once per epoch, budgets kept, deterministic, disjoint
shards per rank, equal step counts, mixing weights, a held-out split that ignores the seed."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from dflash_common.store.format import shard_name, shard_unit

from train.plan import DataPlan, ShardMeta, holdout_split, pack


def _shards(n_stores=1, per_store=6, seqs=10, seed=0):
    r = np.random.default_rng(seed)
    return [
        ShardMeta(
            store,
            f"s{store}-{i:03d}",
            r.integers(5, 60, seqs).astype(np.int64),
            r.integers(0, 40, seqs).astype(np.int64),
        )
        for store in range(n_stores)
        for i in range(per_store)
    ]


def _plan(shards, n_stores=1, min_response=0, holdout=0, **kw):
    split = holdout_split(shards, n_stores, holdout, 0.0, min_response)
    args = dict(
        n_stores=n_stores,
        weights=None,
        seed=0,
        batch_tokens=100,
        shuffle_window_shards=2,
        world=1,
        grad_accum=1,
    )
    args.update(kw)
    return DataPlan(shards, split, **args)


def _seqs(plan):
    return [tuple(r) for b in plan.batches for r in b[:, :2].tolist()]


def test_pack_keeps_order_and_budget_and_truncates_long_sequences():
    seqs = np.array([[0, i] for i in range(5)])
    batches = pack(seqs, np.array([40, 50, 30, 250, 10]), 100)
    assert [b[:, 1].tolist() for b in batches] == [[0, 1], [2], [3], [4]]
    assert [b[:, 2].tolist() for b in batches] == [[40, 50], [30], [100], [10]]


def test_every_training_sequence_once_per_epoch_within_budget_and_deterministic():
    shards = _shards()
    plan = _plan(shards, holdout=5, min_response=10)
    e0 = plan.epoch(0, 0)
    expected = {(s, q) for s, t in enumerate(plan.split.train) for q in t.tolist()}
    assert sorted(_seqs(e0)) == sorted(expected) and len(expected) > 30
    assert all(b[:, 2].sum() <= 100 for b in e0.batches)
    assert _seqs(_plan(shards, holdout=5, min_response=10).epoch(0, 0)) == _seqs(e0)
    assert _seqs(plan.epoch(1, 0)) != _seqs(e0) and sorted(_seqs(plan.epoch(1, 0))) == sorted(
        expected
    )
    for b, w in zip(e0.batches, e0.batch_shuffle_window):  # a batch reads only its window's shards
        assert set(b[:, 0].tolist()) <= set(e0.shuffle_windows[w].tolist())


def test_ranks_read_disjoint_shards_and_step_together():
    plan = _plan(_shards(per_store=9), world=2, grad_accum=2)
    plans = [plan.epoch(0, r) for r in range(2)]
    assert len(plans[0].batches) == len(plans[1].batches) and len(plans[0].batches) % 2 == 0
    shards = [{s for b in p.batches for s in b[:, 0].tolist()} for p in plans]
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    assert plan.steps_in_epoch(0) == len(plans[0].batches) // 2


def test_mixing_weights_set_each_stores_share_of_tokens():
    shards = _shards(n_stores=2, per_store=20)
    plan = _plan(shards, n_stores=2, weights=[3.0, 1.0])
    order = plan.epoch_shards(0)
    tokens = [sum(shards[i].tokens for i in order if shards[i].store == st) for st in (0, 1)]
    assert tokens[0] / sum(tokens) == pytest.approx(0.75, abs=0.06)
    assert len(order) == pytest.approx(40, abs=2)


def test_holdout_is_fixed_by_names_not_the_seed_and_never_trained():
    shards = _shards(per_store=8)
    split = holdout_split(shards, 1, 13, 0.0, 0)
    assert sum(len(v) for v in split.val) == 13 and sum(bool(len(v)) for v in split.val) == 2
    again = holdout_split(list(reversed(shards)), 1, 13, 0.0, 0)  # listing order does not matter
    assert [v.tolist() for v in split.val] == [v.tolist() for v in reversed(again.val)]
    for t, v in zip(split.train, split.val):
        assert not set(t.tolist()) & set(v.tolist())
    assert sum(len(v) for v in holdout_split(shards, 1, 1, 0.5, 0).val) == 40
    val = _plan(shards, holdout=13, seed=5).val_batches(0)
    assert sorted(tuple(r) for b in val for r in b[:, :2].tolist()) == sorted(
        (s, q) for s, v in enumerate(split.val) for q in v.tolist()
    )


def test_stores_of_the_same_units_in_other_codecs_hold_out_the_same_units():
    """Shard names digest the storage dtype and the stored layers; the held-out walk follows the
    work unit alone, so a bf16, an fp8 and a q4 store of the same conversations hold out the same
    ones (and, mixed in one training, none trains on another's held-out sequences)."""
    r = np.random.default_rng(1)
    lengths = [r.integers(5, 60, 10).astype(np.int64) for _ in range(12)]
    names = {
        codec: [
            shard_name(u, hashlib.sha256(f"{codec}{u}".encode()).hexdigest()) for u in range(12)
        ]
        for codec in ("bf16", "fp8_e4m3", "q4_hadamard")
    }
    shards = [
        ShardMeta(store, name, lengths[u], lengths[u] // 2)
        for store, codec in enumerate(names)
        for u, name in enumerate(names[codec])
    ]
    split = holdout_split(shards, 3, 25, 0.0, 0)
    held = [
        {(shard_unit(s.name), q) for s, v in zip(shards, split.val) if s.store == store for q in v}
        for store in range(3)
    ]
    assert len(held[0]) == 25 and held[0] == held[1] == held[2]
    trained = {(shard_unit(s.name), q) for s, t in zip(shards, split.train) for q in t}
    assert not trained & held[0]
    # the walk is not the units' order: a hash of them
    assert {u for u, _ in held[0]} != set(range(len({u for u, _ in held[0]})))


def test_a_window_as_large_as_the_store_shuffles_every_sequence_with_every_other():
    # the full-shuffle setting (issue 17): data.window_shards >= a rank's shards, the cache holding
    # them all
    shards = _shards(per_store=6, seqs=40)
    full = _plan(shards, shuffle_window_shards=1000, batch_tokens=400).epoch(0, 0)
    assert len(full.shuffle_windows) == 1
    assert sorted(full.shuffle_windows[0].tolist()) == list(range(6))
    first = _plan(shards, shuffle_window_shards=1000, batch_tokens=400).epoch(0, 0).batches[:3]
    assert (
        len({s for b in first for s in b[:, 0].tolist()}) > 2
    )  # early batches draw on many shards
    narrow = _plan(shards, shuffle_window_shards=1, batch_tokens=400).epoch(0, 0)
    assert all(len(set(b[:, 0].tolist())) == 1 for b in narrow.batches)  # one shard per batch
    assert sorted(_seqs(full)) == sorted(_seqs(narrow))  # the same sequences, once each, either way
