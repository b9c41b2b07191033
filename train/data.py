"""From stores on disk to packed host batches, as a `torchdata.nodes` pipeline whose position is
checkpointable.

    stores --scan--> ShardMeta --train/plan.py--> batches of (shard, sequence, tokens)
      BatchNode: keeps the current and the next shuffle window requested from the shard cache
                 (reader threads fill pinned slots ahead of need), assembles each planned batch from
                 the slots and draws its anchors
      Prefetcher(BatchNode): assembles `host_prefetch` batches ahead on a thread
      Loader: state_dict() / load_state_dict() give and take the position (epoch, batch index)
    -> train/transfer.py copies each batch to the GPU

A shard occupies one cache slot; slots are sized for the largest shard (chosen layers only). Shards
of one store come from fixed-size work units, so their sizes differ little, and the waste of
fixed-size slots (the gap between a shard and the largest one) is logged at start-up; fixed slots
in exchange never fragment and need no compaction.

Only the layers the drafter reads are read from disk, and a batch lists them in the drafter's
`target_layer_ids` order. Anchors come from `objective.sample_anchors` with a generator seeded by
(seed, epoch, rank, batch index): they change every epoch, and a resumed run draws the same ones
without carrying any generator state.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torchdata.nodes import BaseNode, Loader, Prefetcher

from dflash_common.errors import UserError
from dflash_common.drafter.objective import sample_anchors
from dflash_common.store import Store, StoreCorruptError, StoreError, carve_buffers
from dflash_common.store.contents import incomplete_sentence, missing_sentence, store_contents
from dflash_common.store.quant import has_scale
from train.batch import HostBatch, ShardSlot
from train.cache import Handle, ShardCache, SlotSlab
from train.config import TrainConfig
from train.plan import DataPlan, EpochPlan, ShardMeta, holdout_split, rng

log = logging.getLogger("dflash")

_ANCHORS, _VAL_ANCHORS = 11, 12  # random-stream tags (train/plan.py uses 1-3)


class BadShards:
    """Corrupt shards met while reading (a failed checksum, a cut or missing file, missing
    metadata).

    policy 'stop': the first one raises StoreCorruptError naming it, plus `hint`. policy 'skip': it
    is logged once, counted, and its sequences are left out of every batch from then on. That is
    deterministic: the shard is met at the first batch that needs it, so a resumed run drops exactly
    the sequences an uninterrupted run drops, and the losses stay equal. Shared by the loader thread
    and the main thread (validation)."""

    def __init__(self, policy: str = "stop", hint: str = ""):
        self.policy = policy
        self.hint = hint
        self.skipped: dict[tuple[int, str], str] = {}  # (store index, shard name) -> what is wrong
        self.at_scan = 0  # of them found by the start-up scan (every rank finds those)
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[int, str]) -> bool:
        return key in self.skipped

    def met(self, key: tuple[int, str], error: StoreCorruptError, *, at_scan: bool = False) -> None:
        """Raise (stop) or record (skip) a corrupt shard."""
        if self.policy == "stop":
            raise StoreCorruptError(
                str(error).rstrip(".") + self.hint + ".", error.shard
            ) from error
        with self._lock:
            if key in self.skipped:
                return
            self.skipped[key] = str(error)
            self.at_scan += at_scan
            n = len(self.skipped)
        log.warning(
            "skipping a corrupt shard (data.on_bad_shard = skip; %d skipped so far): %s", n, error
        )

    def found_while_reading(self) -> int:
        return len(self.skipped) - self.at_scan


def check_contents(stores: Sequence[Store], policy: str = "stop", option: str = "") -> None:
    """Each store against its summary. A shard the summary lists but the store lacks stops the run
    naming it and the fix (`policy` 'stop'; `option`, formatted with the number of shards present,
    names the setting that trains without it), or is left out with a warning ('skip'). A store
    without a summary (dflash-precompute still writing it, or stopped) is read as it is, with a
    warning."""
    for store in stores:
        contents = store_contents(store)
        if contents.status == "incomplete":
            log.warning(
                "%s; reading the %d shard(s) it has",
                incomplete_sentence(store.path),
                contents.shards,
            )
        elif contents.missing and policy == "stop":
            fix = option.format(present=contents.shards)
            raise StoreError(missing_sentence(store.path, contents) + fix + ".")
        elif contents.missing:
            log.warning(
                "%s; training on the %d shard(s) there (data.on_bad_shard = skip)",
                missing_sentence(store.path, contents),
                contents.shards,
            )


def scan_stores(
    stores: Sequence[Store], threads: int, batch_tokens: int, bad: BadShards | None = None
) -> list[ShardMeta]:
    """Sequence lengths and response-token counts of every shard (token arrays only, no layer).
    Responses are counted in the part of a sequence a batch keeps (its first `batch_tokens`), so a
    sequence that passes the 2B-response rule always yields anchors. A shard whose metadata or token
    arrays are corrupt goes to `bad` (which raises, or skips it)."""
    bad = bad if bad is not None else BadShards()

    def scan(job: tuple[int, str]) -> ShardMeta | None:
        s, name = job
        try:
            data = stores[s].read_shard(name, layer_ids=[])
        except StoreCorruptError as e:
            bad.met((s, name), e, at_scan=True)
            return None
        starts = data.offsets[:-1].astype(np.int64)
        lengths = np.diff(data.offsets).astype(np.int64)
        ends = starts + np.minimum(lengths, batch_tokens)
        cum = np.concatenate([[0], np.cumsum(data.loss_mask, dtype=np.int64)])  # [T+1]
        return ShardMeta(s, name, lengths, cum[ends] - cum[starts])

    jobs = [(s, name) for s, store in enumerate(stores) for name in store.shard_names()]
    with ThreadPoolExecutor(threads) as pool:
        found = [m for m in pool.map(scan, jobs) if m is not None]
    if not found:
        paths = ", ".join(str(s.path) for s in stores)
        raise UserError(
            f"{paths} hold{'s' if len(stores) == 1 else ''} no readable shard"
            + (f" ({len(bad.skipped)} corrupt ones skipped)" if bad.skipped else "")
            + "; run dflash-precompute to fill the store before training from it."
        )
    return found


def shard_reader(
    stores: Sequence[Store],
    shards: Sequence[ShardMeta],
    layer_ids: Sequence[int],
    final: bool = False,
):
    """The cache's read_fn: read shard `key` (an index into `shards`) straight into its slot; with
    `final`, the target's final normed state travels as one more state after the layers."""

    def read(key: int, views: list[torch.Tensor]) -> tuple[ShardSlot, int]:
        meta = shards[key]
        store = stores[meta.store]
        specs = store.buffer_specs(meta.name, layer_ids, final)
        data = store.read_shard(
            meta.name, layer_ids, out=carve_buffers(specs, views[0]), final=final
        )
        bits = [data.layers[i] for i in layer_ids] + ([data.final] if final else [])
        states = [
            torch.from_numpy(b) for b in bits
        ]  # the stored dtype, as the rule says: no reinterpretation
        scale_arrays = [data.scales.get(i) for i in layer_ids] + (
            [data.final_scale] if final else []
        )
        scales = [torch.from_numpy(x) for x in scale_arrays] if has_scale(data.dtype) else None
        slot = ShardSlot(data.input_ids, data.loss_mask, data.offsets, states, scales, data.dtype)
        return slot, sum(s.nbytes for s in specs.values())

    return read


def slot_size(
    stores: Sequence[Store],
    shards: Sequence[ShardMeta],
    layer_ids: Sequence[int],
    final: bool = False,
) -> tuple[int, float]:
    """Bytes of a slot (the largest shard's read, chosen layers only) and the mean fill of a
    slot."""
    sizes = [stores[m.store].shard_nbytes(m.name, layer_ids, final) for m in shards]
    biggest = max(sizes)
    return biggest, float(np.mean(sizes)) / biggest


def assemble(
    rows: np.ndarray,
    shards: list[ShardSlot],
    slot_of: dict[int, int],
    generator: torch.Generator,
    block_size: int,
    max_anchors: int,
    epoch: int,
    index: int,
    handles: list[Handle],
    anchor_rule: str = "block",
    prompt_anchors: bool = False,
) -> HostBatch:
    """Planned rows [n, 3] (shard, sequence, tokens) -> a HostBatch, anchors drawn from `generator`
    by `anchor_rule` (objective.sample_anchors) among response positions (any position with
    `prompt_anchors`: targets.prompt_anchors)."""
    ids, mask, segments, lengths, dst = [], [], [], [], 0
    for shard, seq, n in rows.tolist():
        slot = shards[slot_of[shard]]
        src = int(slot.offsets[seq])
        ids.append(slot.input_ids[src : src + n])
        mask.append(slot.loss_mask[src : src + n])
        segments.append((slot_of[shard], src, dst, n))
        lengths.append(n)
        dst += n
    # the dtypes of train/transfer.py's DeviceBatch; the mask travels as int64 0/1 beside the others
    input_ids = torch.from_numpy(np.concatenate(ids).astype(np.int64))
    response = torch.from_numpy(np.concatenate(mask).astype(bool))
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    anchor_mask = torch.ones_like(response) if prompt_anchors else response
    anchors = sample_anchors(anchor_mask, cu, block_size, max_anchors, generator, anchor_rule)
    loss_mask = response.long()
    return HostBatch(epoch, index, input_ids, loss_mask, cu, anchors, segments, shards, handles)


def seeded_generator(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(rng(*key).integers(0, 2**63 - 1)))


@dataclasses.dataclass
class FailedBatch:
    """Stands in the loader's queue for a batch that could not be made (a corrupt shard under policy
    'stop'). torchdata re-raises an error of its thread as a RuntimeError holding a traceback in its
    text; handed over as an item, the error reaches the training loop unchanged (`raise_failures`)
    and ends the run as one sentence."""

    error: BaseException


def raise_failures(items: Iterator[Any]) -> Iterator[Any]:
    """Pass batches through; raise the error of a FailedBatch on the consumer's thread."""
    for item in items:
        if isinstance(item, FailedBatch):
            raise item.error
        yield item


def usable_rows(rows: np.ndarray, shards: Sequence[ShardMeta], bad: BadShards) -> np.ndarray:
    """Planned rows [n, 3] less those of shards skipped as corrupt."""
    if not bad.skipped:
        return rows
    keep = [(shards[s].store, shards[s].name) not in bad for s in rows[:, 0].tolist()]
    return rows[np.array(keep, dtype=bool)]


def wait_for_shards(
    rows: np.ndarray, cache: ShardCache, shards: Sequence[ShardMeta], bad: BadShards
):
    """(keys, handles, slots) of the shards planned rows need, once all are read; None when one
    turned out corrupt (it went to `bad`, which raised or recorded it: drop its rows and try
    again)."""
    keys = sorted(set(rows[:, 0].tolist()))
    handles = [cache.request(k) for k in keys]
    slots = []
    for key, handle in zip(keys, handles):
        try:
            slots.append(handle.wait())
        except StoreCorruptError as e:
            for h in handles:
                h.release()
            bad.met((shards[key].store, shards[key].name), e)
            return None
    return keys, handles, slots


def wait_for_usable(
    planned: np.ndarray, cache: ShardCache, shards: Sequence[ShardMeta], bad: BadShards
):
    """(rows, keys, handles, slots) of a planned batch's rows whose shards are readable, once read;
    None when none is left (every shard it needs is corrupt and skipped)."""
    while True:
        rows = usable_rows(planned, shards, bad)
        if not len(rows):
            return None
        got = wait_for_shards(rows, cache, shards, bad)
        if got is not None:
            return (rows, *got)


class BatchNode(BaseNode[HostBatch]):
    """The training batches of one rank, epoch after epoch; state = {epoch, index} of the next
    batch."""

    def __init__(
        self,
        plan: DataPlan,
        cache: ShardCache,
        *,
        rank: int,
        seed: int,
        block_size: int,
        max_anchors: int,
        bad: BadShards | None = None,
        anchor_rule: str = "block",
        prompt_anchors: bool = False,
    ):
        super().__init__()
        self.prompt_anchors = prompt_anchors
        self.plan = plan
        self.cache = cache
        self.rank = rank
        self.seed = seed
        self.block_size = block_size
        self.max_anchors = max_anchors
        self.anchor_rule = anchor_rule  # training only: validation keeps 'block', so runs compare
        self.bad = bad if bad is not None else BadShards()
        self.epoch = 0
        self.index = 0
        # (epoch, shuffle window) -> the handles that keep its shards requested
        self._shuffle_windows: dict[tuple[int, int], list[Handle]] = {}
        self._failure: FailedBatch | None = None

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._release_shuffle_windows(keep=())
        self._failure = None
        state = initial_state or {"epoch": 0, "index": 0}
        self.epoch, self.index = int(state["epoch"]), int(state["index"])

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def _current(self) -> EpochPlan:
        p = self.plan.epoch(self.epoch, self.rank)
        if not p.batches:
            raise RuntimeError(
                f"epoch {self.epoch} has no batches for rank {self.rank}: too few shards or "
                f"usable sequences for {self.plan.world} rank(s)"
            )
        if self.index >= len(p.batches):
            self.epoch, self.index = self.epoch + 1, 0
            return self._current()
        return p

    def next(self) -> HostBatch | FailedBatch:
        if self._failure is None:
            try:
                return self._next()
            except UserError as e:  # runs on the prefetch thread: hand the error over as an item
                self._failure = FailedBatch(e)
        return self._failure

    def _next(self) -> HostBatch:
        while True:
            p = self._current()
            self._hold_shuffle_windows(p, int(p.batch_shuffle_window[self.index]))
            got = wait_for_usable(p.batches[self.index], self.cache, self.plan.shards, self.bad)
            if got is not None:
                break
            self._check_some_shard_left()  # every sequence of this batch is in skipped shards
            self.index += 1
        rows, keys, handles, slots = got
        gen = seeded_generator(self.seed, _ANCHORS, self.epoch, self.rank, self.index)
        batch = assemble(
            rows,
            slots,
            {k: i for i, k in enumerate(keys)},
            gen,
            self.block_size,
            self.max_anchors,
            self.epoch,
            self.index,
            handles,
            self.anchor_rule,
            self.prompt_anchors,
        )
        self.index += 1
        return batch

    def _check_some_shard_left(self) -> None:
        if all((m.store, m.name) in self.bad for m in self.plan.shards):
            raise UserError(
                f"every one of the {len(self.plan.shards)} shards planned for training is corrupt; "
                f"rerun dflash-precompute to rewrite them."
            )

    def _hold_shuffle_windows(self, p: EpochPlan, window: int) -> None:
        """Keep the current shuffle window and the next one (maybe the next epoch's first)
        requested."""
        wanted = [(p.epoch, window)]
        if window + 1 < len(p.shuffle_windows):
            wanted.append((p.epoch, window + 1))
        else:
            wanted.append((p.epoch + 1, 0))
        for epoch, w in wanted:
            if (epoch, w) not in self._shuffle_windows:
                plan = p if epoch == p.epoch else self.plan.epoch(epoch, self.rank)
                shards = plan.shuffle_windows[w].tolist() if w < len(plan.shuffle_windows) else []
                usable = [
                    s
                    for s in shards
                    if (self.plan.shards[s].store, self.plan.shards[s].name) not in self.bad
                ]
                self._shuffle_windows[(epoch, w)] = [
                    self.cache.request(s, count=False) for s in usable
                ]
        self._release_shuffle_windows(keep=wanted)

    def _release_shuffle_windows(self, keep: Sequence[tuple[int, int]]) -> None:
        for key in [k for k in self._shuffle_windows if k not in keep]:
            for h in self._shuffle_windows.pop(key):
                h.release()


def val_batches(
    plan: DataPlan,
    cache: ShardCache,
    *,
    rank: int,
    block_size: int,
    max_anchors: int,
    bad: BadShards | None = None,
):
    """This rank's held-out batches, with fixed anchors (seeded by the batch, not the run): every
    validation of every run of the same store draws the same blocks. Generator of HostBatch."""
    bad = bad if bad is not None else BadShards()
    for i, planned in enumerate(plan.val_batches(rank)):
        got = wait_for_usable(planned, cache, plan.shards, bad)
        if got is None:
            continue
        rows, keys, handles, slots = got
        gen = seeded_generator(0, _VAL_ANCHORS, rank, i)
        yield assemble(
            rows,
            slots,
            {k: j for j, k in enumerate(keys)},
            gen,
            block_size,
            max_anchors,
            -1,
            i,
            handles,
        )


def build_loader(node: BatchNode, host_prefetch: int) -> Loader:
    """The checkpointable pipeline: `host_prefetch` batches assembled ahead on a thread."""
    return Loader(Prefetcher(node, prefetch_factor=host_prefetch), restart_on_stop_iteration=False)


def allocate_cache(
    stores: Sequence[Store],
    shards: Sequence[ShardMeta],
    layer_ids: Sequence[int],
    *,
    cache_gb: float,
    min_shards: int,
    threads: int,
    what: str,
    final: bool = False,
) -> ShardCache:
    """A cache of as many whole-shard slots as `cache_gb` holds (at least `min_shards`)."""
    nbytes, fill = slot_size(stores, shards, layer_ids, final)
    n = min(
        int(cache_gb * 2**30) // nbytes, len(shards)
    )  # more slots than shards would never be used
    min_shards = min(min_shards, len(shards))  # a store smaller than two shuffle windows fits whole
    if n < min_shards:
        from dflash_common.errors import UserError

        raise UserError(
            f"data.cache_gb = {cache_gb} (GiB) holds {n} shard(s) of {nbytes / 2**30:.3f} GiB, but "
            f"the {what} needs {min_shards}; raise data.cache_gb to at least "
            f"{min_shards * nbytes / 2**30:.3f} or lower data.window_shards."
        )
    log.info(
        "%s shard cache: %d slots of %.1f MiB, one shard each (slots fit the largest shard of "
        "layers %s; shards fill %.0f%% of a slot on average)",
        what,
        n,
        nbytes / 2**20,
        list(layer_ids),
        100 * fill,
    )
    return ShardCache(
        SlotSlab.allocate(n, nbytes), 1, shard_reader(stores, shards, layer_ids, final), threads
    )


def feature_dtype(autocast: str) -> torch.dtype:
    """Context features arrive in the compute dtype: bf16 under bf16 autocast, else float32."""
    return torch.bfloat16 if autocast == "bf16" else torch.float32


def make_feeder(
    source,
    position,
    stores: Sequence[Store],
    layer_ids: Sequence[int],
    *,
    device: torch.device,
    batch_tokens: int,
    autocast: str,
    prefetch: int,
    final: bool = False,
):
    from train.transfer import DeviceFeeder

    dtypes = sorted({s.manifest.dtype for s in stores})  # stores of several dtypes mix in one batch
    return DeviceFeeder(
        source,
        position,
        device=device,
        layers=len(layer_ids) + (1 if final else 0),
        final=final,
        hidden=stores[0].manifest.hidden_size,
        dtypes=dtypes,
        batch_tokens=batch_tokens,
        feature_dtype=feature_dtype(autocast),
        prefetch=prefetch,
    )


def check_final_states(stores: Sequence[Store]) -> None:
    """Soft targets and prompt anchors read the target's final states: every store must hold
    them."""
    from dflash_common.errors import UserError

    for store in stores:
        if not store.manifest.final_state:
            raise UserError(
                f"store {store.path} holds no final states, which targets.soft and "
                "targets.prompt_anchors need; precompute it with --store.final_state=true, or "
                "train with --targets.soft=none --targets.prompt_anchors=false."
            )


def check_stores_agree(stores: Sequence[Store]) -> None:
    """Batches mix stores, so their states must share one hidden size (storage dtypes may differ:
    each is decoded on the device into the same features)."""
    from dflash_common.errors import UserError

    first = stores[0].manifest
    for store in stores[1:]:
        m = store.manifest
        if m.hidden_size != first.hidden_size:
            raise UserError(
                f"store {store.path} holds states of hidden size {m.hidden_size} but "
                f"{stores[0].path} holds {first.hidden_size}; mix only stores of one target."
            )


class TrainData:
    """Everything between the stores and the training loop, for one rank: the plan, the shard caches
    (training, and a small one for held-out shards), the checkpointable loader and the GPU
    feeder."""

    def __init__(
        self,
        plan: DataPlan,
        cache: ShardCache,
        val_cache: ShardCache | None,
        node: BatchNode,
        loader: Loader,
        feeder_args: dict[str, Any],
        gpu_prefetch: int,
        bad: BadShards,
    ):
        self.plan = plan
        self.cache = cache
        self.val_cache = val_cache
        self.node = node
        self.loader = loader
        self.feeder_args = feeder_args  # make_feeder's arguments, shared by training and validation
        self.gpu_prefetch = gpu_prefetch
        self.bad = bad  # corrupt shards met so far (data.on_bad_shard)
        self.feeder = None

    @classmethod
    def build(
        cls,
        cfg: TrainConfig,
        stores: Sequence[Store],
        layer_ids: Sequence[int],
        *,
        rank: int,
        world: int,
        device: torch.device,
        block_size: int | None = None,
    ) -> "TrainData":
        """`layer_ids`: the drafter's target_layer_ids (their order is kept); `block_size` the
        verified block's tokens (DrafterConfig.verify_block_size: a DSpark block's labels reach one
        token further), by default drafter.block_size."""
        d = cfg.data
        block_size = block_size or cfg.drafter.block_size
        check_stores_agree(stores)
        final = cfg.targets.needs_final_state
        if final:
            check_final_states(stores)
        check_contents(
            stores,
            d.on_bad_shard,
            ', or set data.on_bad_shard = "skip" to train on the {present} shards there',
        )
        bad = BadShards(
            d.on_bad_shard, hint=', or set data.on_bad_shard = "skip" to train without it'
        )
        shards = scan_stores(stores, d.reader_threads, d.batch_tokens, bad)
        split = holdout_split(
            shards,
            len(stores),
            d.holdout_sequences,
            d.holdout_fraction,
            2 * block_size,
            d.holdout_by,
        )  # sequences with < 2B response tokens are dropped
        plan = DataPlan(
            shards,
            split,
            n_stores=len(stores),
            weights=d.weights,
            seed=cfg.run.seed,
            batch_tokens=d.batch_tokens,
            shuffle_window_shards=d.window_shards,
            world=world,
            grad_accum=cfg.optim.grad_accum,
        )
        cache = allocate_cache(
            stores,
            shards,
            layer_ids,
            cache_gb=d.cache_gb,
            min_shards=2 * d.window_shards,
            threads=d.reader_threads,
            what="training",
            final=final,
        )
        val_shards = sum(1 for v in split.val if len(v))
        val_cache = None
        if (
            val_shards
        ):  # held-out shards get their own slots, so validation never waits on training's
            n = min(val_shards, 2)
            log.info(
                "validation shard cache: %d slot(s) for the %d shard(s) holding held-out sequences",
                n,
                val_shards,
            )
            val_cache = ShardCache(
                SlotSlab.allocate(n, cache.slab.slot_bytes),
                1,
                shard_reader(stores, shards, layer_ids, final),
                threads=1,
            )
        node = BatchNode(
            plan,
            cache,
            rank=rank,
            seed=cfg.run.seed,
            block_size=block_size,
            max_anchors=cfg.objective.max_anchors,
            bad=bad,
            anchor_rule=cfg.objective.anchors,
            prompt_anchors=cfg.targets.prompt_anchors,
        )
        loader = build_loader(node, d.host_prefetch)
        feeder_args = dict(
            stores=stores,
            layer_ids=list(layer_ids),
            device=device,
            batch_tokens=d.batch_tokens,
            autocast=cfg.precision.autocast,
            final=final,
        )
        return cls(plan, cache, val_cache, node, loader, feeder_args, d.gpu_prefetch, bad)

    def start(self, position: dict[str, Any] | None = None):
        """Begin iterating, at `position` (a loader state from a checkpoint) or at the start."""
        if position is not None:
            self.loader.load_state_dict(position)
        self.feeder = make_feeder(
            raise_failures(iter(self.loader)),
            self.loader.state_dict,
            prefetch=self.gpu_prefetch,
            **self.feeder_args,
        )
        return self.feeder

    def val_batches(self):
        """Device batches of this rank's share of the held-out sequences (copied one at a time)."""
        if self.val_cache is None:
            return
        node = self.node
        host = val_batches(
            self.plan,
            self.val_cache,
            rank=node.rank,
            block_size=node.block_size,
            max_anchors=node.max_anchors,
            bad=self.bad,
        )
        feeder = make_feeder(host, dict, prefetch=0, **self.feeder_args)
        try:
            yield from feeder
        finally:
            feeder.close()

    def close(self) -> None:
        """Stop the loader thread and the readers, then free (unpin) the caches."""
        if self.feeder is not None:
            self.feeder.close()
        for cache in (self.cache, self.val_cache):
            if cache is not None:
                cache.close()  # wakes a loader thread waiting for a shard
        prefetch = getattr(
            self.loader.root, "_it", None
        )  # torchdata offers no public way to stop it
        if prefetch is not None:
            prefetch._shutdown()
        for cache in (self.cache, self.val_cache):
            if cache is not None:
                cache.slab.close()
