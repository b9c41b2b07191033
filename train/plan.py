"""Which sequences go into which batch: a pure function of the stores' metadata, the seed and the
epoch.

Per epoch, on every rank alike:
1. each store's shards are shuffled; with mixing weights, a store's shards are repeated or cut so
   that it supplies weights[i]/sum(weights) of the epoch's tokens; all stores' shards are shuffled
   together;
2. shard k of that order goes to rank k % world (the tail that does not divide evenly waits for the
   next epoch's order), so ranks read disjoint shards into their own caches;
3. a rank's shards are grouped into shuffle windows of `shuffle_window_shards`
   (data.window_shards); the sequences of one shuffle window are shuffled together and packed
   greedily, in that order, into batches of at most `batch_tokens` tokens (a sequence longer than
   the budget is truncated to it: its tail is not trained on);
4. every rank keeps the same number of batches (the fewest any rank has, rounded down to a multiple
   of grad_accum) so that DDP ranks step together.

Because the plan depends on nothing else, the position in the data is just (epoch, batch index), and
a resumed run sees exactly the batches it would have seen. Held-out sequences are chosen once,
without the seed, so runs with different seeds or drafters are validated on the same sequences.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading

import numpy as np

from dflash_common.store.format import shard_unit

# Tags keep the random streams of different purposes apart (numpy SeedSequence mixes the whole key).
_SHARD_ORDER, _MIX, _SHUFFLE_WINDOW = 1, 2, 3


def rng(*key: int) -> np.random.Generator:
    """A generator for one purpose, seeded by a tuple of non-negative ints."""
    return np.random.default_rng([int(k) for k in key])


@dataclasses.dataclass(frozen=True)
class ShardMeta:
    """What planning needs to know of a shard: where it is and its sequences' sizes."""

    store: int  # index into the run's list of stores
    name: str
    lengths: np.ndarray  # int64 [N] tokens per sequence
    responses: (
        np.ndarray
    )  # int64 [N] loss-mask (response) tokens in the part of each sequence trained on

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """One rank's batches of one epoch. A batch is int64 [n, 3]: (shard, sequence, tokens used)."""

    epoch: int
    batches: list[np.ndarray]
    batch_shuffle_window: np.ndarray  # int64 [len(batches)]: each batch's shuffle window
    shuffle_windows: list[np.ndarray]  # per shuffle window: the shard indices it reads


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _holdout_key(name: str, by: str) -> int:
    """Where a shard comes in the held-out walk. by='unit': a hash of its work unit (the input's
    position), not of its whole name, whose digest covers the storage dtype and the stored layers,
    so stores of the same conversations in another codec, or with final states, hold out the same
    ones: their validation figures compare, and mixed in one training none trains on what another
    holds out. by='name': a hash of the whole name (runs started before data.holdout_by)."""
    unit = shard_unit(name) if by == "unit" else None
    return _stable_hash(name if unit is None else f"unit {unit}")


@dataclasses.dataclass(frozen=True)
class Split:
    """Per shard, the sequences trained on and those held out for validation."""

    train: list[np.ndarray]  # int64 sequence indices per shard
    val: list[np.ndarray]


def holdout_split(
    shards: list[ShardMeta],
    n_stores: int,
    count: int,
    fraction: float,
    min_response: int,
    by: str = "unit",
) -> Split:
    """Hold out the first max(count, fraction * sequences) sequences of each store, walking its
    shards in the order of a hash of their work units (`by`, `_holdout_key`; no seed: every run of
    every drafter holds out the same ones). Sequences with fewer than `min_response` response
    tokens are neither trained nor validated on."""
    held = [np.zeros(len(s.lengths), dtype=bool) for s in shards]
    for store in range(n_stores):
        mine = [i for i, s in enumerate(shards) if s.store == store]
        total = sum(len(shards[i].lengths) for i in mine)
        left = max(count, int(np.ceil(fraction * total)))
        for i in sorted(mine, key=lambda i: (_holdout_key(shards[i].name, by), shards[i].name)):
            take = min(left, len(shards[i].lengths))
            held[i][:take] = True
            left -= take
            if left == 0:
                break
    usable = [s.responses >= min_response for s in shards]
    return Split(
        train=[np.flatnonzero(u & ~h) for u, h in zip(usable, held)],
        val=[np.flatnonzero(u & h) for u, h in zip(usable, held)],
    )


def pack(seqs: np.ndarray, lengths: np.ndarray, budget: int) -> list[np.ndarray]:
    """Greedy packing in the given order: int64 [n, 2] (shard, sequence) -> batches [m, 3] of at
    most `budget` tokens; a sequence longer than the budget is truncated to it."""
    used = np.minimum(lengths, budget)
    batches, start, total = [], 0, 0
    for i, n in enumerate(used.tolist()):
        if total + n > budget:
            batches.append(np.arange(start, i))
            start, total = i, 0
        total += n
    if start < len(used):
        batches.append(np.arange(start, len(used)))
    return [np.column_stack([seqs[b], used[b]]).astype(np.int64) for b in batches]


class DataPlan:
    """The batches of every epoch for every rank, derived from the stores' metadata alone."""

    def __init__(
        self,
        shards: list[ShardMeta],
        split: Split,
        *,
        n_stores: int,
        weights: list[float] | None,
        seed: int,
        batch_tokens: int,
        shuffle_window_shards: int,
        world: int,
        grad_accum: int,
    ):
        self.shards = shards
        self.split = split
        self.n_stores = n_stores
        self.weights = weights
        self.seed = seed
        self.batch_tokens = batch_tokens
        self.shuffle_window_shards = shuffle_window_shards
        self.world = world
        self.grad_accum = grad_accum
        self._plans: dict[int, tuple[int, list[EpochPlan]]] = {}  # the two latest epochs planned
        self._lock = (
            threading.Lock()
        )  # the loader thread plans ahead while the loop asks for counts

    def train_tokens(self, shard: int) -> int:
        return int(self.shards[shard].lengths[self.split.train[shard]].sum())

    def epoch_shards(self, epoch: int) -> np.ndarray:
        """The epoch's global shard order (before the split over ranks)."""
        per_store = []
        for store in range(self.n_stores):
            mine = np.array(
                [
                    i
                    for i, s in enumerate(self.shards)
                    if s.store == store and len(self.split.train[i])
                ],
                dtype=np.int64,
            )
            per_store.append(
                mine[rng(self.seed, _SHARD_ORDER, epoch, store).permutation(len(mine))]
            )
        if self.weights is not None:
            per_store = self._mix(per_store)
        order = np.concatenate(per_store) if per_store else np.zeros(0, dtype=np.int64)
        return order[rng(self.seed, _MIX, epoch).permutation(len(order))]

    def _mix(self, per_store: list[np.ndarray]) -> list[np.ndarray]:
        """Repeat or cut each store's shard list so its tokens are its weight's share of the
        total."""
        tokens = [sum(self.train_tokens(i) for i in s) for s in per_store]
        total, weight_sum = sum(tokens), sum(self.weights)
        mixed = []
        for shards, have, w in zip(per_store, tokens, self.weights):
            if len(shards) == 0:
                mixed.append(shards)
                continue
            want = total * w / weight_sum
            n = max(1, int(round(want / (have / len(shards)))))
            mixed.append(np.resize(shards, n))  # cycles through the shuffled list
        return mixed

    def _rank_plan(self, epoch: int, rank: int, order: np.ndarray) -> EpochPlan:
        usable = len(order) - len(order) % self.world
        mine = order[:usable][rank :: self.world]
        size = self.shuffle_window_shards
        shuffle_windows = [mine[i : i + size] for i in range(0, len(mine), size)]
        batches, batch_shuffle_window = [], []
        for w, shards in enumerate(shuffle_windows):
            seqs = np.concatenate(
                [
                    np.column_stack([np.full(len(self.split.train[s]), s), self.split.train[s]])
                    for s in shards
                ]
            ).astype(np.int64)  # [n, 2] (shard, sequence)
            lengths = np.concatenate(
                [self.shards[s].lengths[self.split.train[s]] for s in shards]
            )  # [n]
            order = rng(self.seed, _SHUFFLE_WINDOW, epoch, rank, w).permutation(len(seqs))
            packed = pack(seqs[order], lengths[order], self.batch_tokens)
            batches += packed
            batch_shuffle_window += [w] * len(packed)
        return EpochPlan(
            epoch, batches, np.array(batch_shuffle_window, dtype=np.int64), shuffle_windows
        )

    def epoch(self, epoch: int, rank: int) -> EpochPlan:
        """Rank `rank`'s batches of `epoch`, cut to the length every rank shares."""
        with self._lock:
            return self._epoch(epoch, rank)

    def _epoch(self, epoch: int, rank: int) -> EpochPlan:
        if epoch not in self._plans:
            order = self.epoch_shards(epoch)
            plans = [self._rank_plan(epoch, r, order) for r in range(self.world)]
            n = min(len(p.batches) for p in plans)
            n -= n % self.grad_accum
            while len(self._plans) >= 2:  # the epoch trained and the next one being prefetched
                del self._plans[min(self._plans)]
            self._plans[epoch] = (n, plans)
        n, plans = self._plans[epoch]
        p = plans[rank]
        return EpochPlan(epoch, p.batches[:n], p.batch_shuffle_window[:n], p.shuffle_windows)

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimiser steps of one epoch (the same on every rank)."""
        return len(self.epoch(epoch, 0).batches) // self.grad_accum

    def val_batches(self, rank: int) -> list[np.ndarray]:
        """This rank's share of the held-out sequences, packed shard by shard in a fixed order."""
        batches = []
        for s, seqs in enumerate(self.split.val):
            if len(seqs):
                pairs = np.column_stack([np.full(len(seqs), s), seqs]).astype(np.int64)
                batches += pack(pairs, self.shards[s].lengths[seqs], self.batch_tokens)
        return batches[rank :: self.world]
