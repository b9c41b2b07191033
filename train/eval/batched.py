"""Greedy speculative decoding of many prompts at once: spec_decode.py's draft-verify loop, batched.

Every row of the batch is one prompt at its own position. The caches are indexed by position: slot p
of row n holds the keys/values of that row's position p (`SlotCache` for the target, the drafter's
own for its context), so each row's block is written where it belongs, and what a query sees is one
comparison of positions:

    target:  slot j is visible to a query at position q  iff  j <= q   (and q - j < window: sliding)

A row's committed tokens lie below its anchor. Every slot at or past the anchor holds either this
forward's own block or something stale (a rejected draft, a shorter prompt's padding), and a stale
slot always lies past every query of its row, so the causal rule alone hides it until the row's
next block overwrites it. No slot is cleared, no per-row bookkeeping of holes is kept, and the
buffers never move: the masks are one broadcast comparison per forward, on the device.

One cycle, for all rows at once (anchors at positions s [N]):

    drafts = drafter.propose_block(anchors, s, B-1)              # [N, B-1]: positions s+1 .. s+B-1
    logits, feats = target([anchor, drafts] at s .. s+B-1)       # [N, B, V], [N, B, K*H]
    choice = argmax(logits); accepted = leading run of (drafts == choice[:, :-1])
    drafter.extend(feats, s)          # context at s .. s+B-1; slots past s + accepted are stale
    s += accepted + 1; anchors = choice[accepted]

The cycle's one host sync reads the accepted lengths and the target's choices (the new tokens, the
stop check); the state that drives the next cycle stays on the device. The counting is the
one-at-a-time loop's (spec_decode.py, the DFlash authors' `spec_generate`), row by row: whole blocks
while the anchor is below the row's limit, every cycle counted uncut, a row stops after the cycle
whose output holds a stop token; in float32 each row's cycles are the one-at-a-time loop's
(tests/train/eval/test_batched.py).

A DSpark drafter's confidence schedule verifies a number of drafts of each row's own: its
unverified drafts are UNVERIFIED, which no target choice equals, so `accepted` stops before them and
the target's next token is the one after the verified ones, as when the one-at-a-time loop sends
only those (the target still runs the whole block: the rows stay one shape).

Rows that finish stop advancing (their position is frozen and their output no longer read); once
half of the batch has finished, the caches are compacted to the live rows, so the tail of long
answers runs at the width it needs. Finished rows are not refilled with new prompts: a new prompt
needs a prefill, a forward of another shape beside the batch's verify forward, and the evaluations
this serves (a few hundred prompts) fit in one or two batches; more prompts than a batch holds are
decoded in successive batches of similar prompt lengths (run.py).

Greedy only: the sampled accept/resample rule stays on the one-at-a-time path, whose per-prompt
generators make sampled runs reproducible prompt by prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import Cache

from dflash_common.drafter.layer_ids import hf_hidden_states_index
from train.eval.spec_decode import (
    Decoded,
    DFlashProposer,
    _cache_keyword,
    _cut_at_stop,
    TargetRunner,
    emitted_lengths,
)

# Tokens one prefill forward takes (rows x the widest prompt among them): bounds the hidden states
# of every layer that the drafter's context needs at once (~2.5 GB at Qwen3-8B's width, bf16).
PREFILL_TOKENS = 8192
# The target-alone loop reads its tokens back every this many steps (at most): one host sync per
# this many forwards instead of one per token; rows that stopped meanwhile decoded a few tokens
# more.
CHECK_EVERY = 16
# Compact the batch to its live rows when at most this share of it is still decoding.
COMPACT_AT = 0.5

# A draft the target does not verify: no token equals it, so acceptance stops before it.
UNVERIFIED = -1

OnTokens = Callable[[int], None]  # progress: this many more of the batch's tokens are done


class BatchedDrafter(Protocol):
    """What the batched loop asks of a drafter. Context comes as the target's features of whole
    blocks; features at or past a row's anchor are not committed and must be overwritten later,
    never read (the drafter's cache is indexed by position, like the target's)."""

    block_size: int
    layer_ids: list[int]

    def start(self, prompts: Sequence[Sequence[int]], length: int) -> None:
        """A new batch: row i decodes prompts[i]; every position stays below `length`."""

    def extend(
        self, context: torch.Tensor, starts: torch.Tensor, rows: slice = slice(None)
    ) -> None:
        """context [n, T, K*H]: target features of rows `rows` at positions starts[i] ..
        starts[i]+T-1."""

    def propose_block(
        self, anchors: torch.Tensor, starts: torch.Tensor, num_drafts: int
    ) -> torch.Tensor:
        """anchors [N] (the tokens at positions starts [N]) -> drafts [N, num_drafts] for the
        positions after them; a draft the target is not to verify (a confidence schedule's) is
        UNVERIFIED, and so is every draft after it in its row."""

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in `rows` (indices into the batch); the rest keep their order."""


# ---------------------------------------------------------------- the target


class SlotCache(Cache):
    """The target's KV cache for a batch: per layer keys and values [N, kv heads, length, head dim],
    slot p holding position p. Before each forward the caller sets `positions` [n, q] (where this
    forward's tokens go) and `rows` (which rows it runs: a prefill runs a slice of the batch); each
    attention layer calls `update`, which writes there and returns the rows' whole buffers. A
    `Cache` for models that check, but none of its layer machinery is used."""

    def __init__(self, rows: int, length: int):
        super().__init__(layers=[])
        self.num_rows, self.length = rows, length
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions: torch.Tensor | None = None
        self.rows = slice(None)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ):
        """key_states, value_states [n, kv heads, q, D] -> the rows' keys and values
        [n, kv heads, length, D]."""
        if layer_idx == len(self.keys):  # the first forward allocates; zeros: masked slots finite
            _, heads, _, dim = key_states.shape
            self.keys.append(key_states.new_zeros(self.num_rows, heads, self.length, dim))
            self.values.append(value_states.new_zeros(self.num_rows, heads, self.length, dim))
        keys, values = self.keys[layer_idx][self.rows], self.values[layer_idx][self.rows]  # views
        index = self.positions[:, None, :, None].expand_as(key_states)  # [n, kv heads, q, D]
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are given with every forward; nothing derives them from the cache

    def keep(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.num_rows = rows.shape[0]


def batch_refusal(model) -> str | None:
    """Why this target cannot run batched (None when it can): its attention must take our 4-D masks,
    and every layer must be a full or sliding attention layer over a KV cache."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return (
            f"target.attn_implementation = {impl!r} takes no per-row masks (use 'sdpa' or 'eager')"
        )
    kinds = set(getattr(model.config.get_text_config(), "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention", "sliding_attention"}:
        other = sorted(kinds - {"full_attention", "sliding_attention"})
        return f"the target has {other} layers, which keep no KV cache"
    return None


class BatchedTarget:
    """The target over a `SlotCache`: forwards of [n, q] tokens at per-row positions, returning
    float32 logits and the features (outputs of `layer_ids`, concatenated) the drafter reads."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.decoder = model.base_model  # the layers; the head is applied to the rows that need it
        self.head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        text = model.config.get_text_config()
        self.window = getattr(text, "sliding_window", None)
        self.sliding = "sliding_attention" in (getattr(text, "layer_types", None) or [])
        self.eager = model.config._attn_implementation == "eager"
        self.cache: SlotCache | None = None
        self.slots: torch.Tensor | None = None

    def start(self, rows: int, length: int) -> None:
        self.cache = SlotCache(rows, length)
        self.slots = torch.arange(length, device=self.device)

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.keep(rows)

    def masks(self, positions: torch.Tensor):
        """positions [n, q] -> the mask [n, 1, q, length] (one per layer type when some slide)."""
        q_pos = positions[:, None, :, None]
        # committed and this forward's own earlier tokens; stale slots lie past every q
        full = self.slots <= q_pos
        masks = {"full_attention": full}
        if self.sliding:
            masks["sliding_attention"] = full & (q_pos - self.slots < self.window)
        if self.eager:  # eager attention adds its mask to the scores
            dtype = next(self.model.parameters()).dtype
            masks = {
                k: torch.zeros((), dtype=dtype, device=self.device).masked_fill(
                    ~m, torch.finfo(dtype).min
                )
                for k, m in masks.items()
            }
        return masks if self.sliding else masks["full_attention"]

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        features: bool,
        rows: slice = slice(None),
        last: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [n, q] at positions [n, q] of rows `rows` -> (logits [n, q, V], or [n, 1, V] at
        the columns `last` [n]; features [n, q, K*H] or None)."""
        self.cache.positions, self.cache.rows = positions, rows
        want_states = features and bool(self.layer_ids)
        out = self.decoder(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=self.masks(positions),
            use_cache=True,
            output_hidden_states=want_states,
            **{_cache_keyword(type(self.decoder)): self.cache},
        )
        hidden = out.last_hidden_state  # [n, q, H]
        if last is not None:
            every = torch.arange(hidden.shape[0], device=self.device)
            hidden = hidden[every, last][:, None]  # [n, 1, H]
        feats = None
        if features:
            states = [out.hidden_states[hf_hidden_states_index(i)] for i in self.layer_ids]
            feats = (
                torch.cat(states, dim=-1)
                if states
                else tokens.new_zeros((*tokens.shape, 0), dtype=torch.float32)
            )
        return self.head(hidden).float(), feats

    clock = TargetRunner.clock  # timed as one prompt at a time is


def prefill(
    target: BatchedTarget, drafter: BatchedDrafter | None, prompts: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Every prompt through the target (slots 0..P-1 of its row), in slices of rows of at most
    PREFILL_TOKENS tokens; the drafter, if any, takes their features as context. -> the target's
    first tokens [N] (greedy), on the device."""
    first = torch.empty(len(prompts), dtype=torch.long, device=target.device)
    a = 0
    while a < len(prompts):
        b, width = a + 1, len(prompts[a])
        while b < len(prompts) and (b + 1 - a) * max(width, len(prompts[b])) <= PREFILL_TOKENS:
            b, width = b + 1, max(width, len(prompts[b]))
        chunk = prompts[a:b]
        padded = [list(p) + [0] * (width - len(p)) for p in chunk]
        tokens = torch.tensor(padded, device=target.device)  # [n, W]
        # the padding lands in stale slots, past P
        positions = torch.arange(width, device=target.device).expand(b - a, width)
        last = torch.tensor([len(p) - 1 for p in chunk], device=target.device)
        logits, feats = target.forward(
            tokens, positions, features=drafter is not None, rows=slice(a, b), last=last
        )
        first[a:b] = logits[:, 0].argmax(-1)
        if drafter is not None:
            drafter.extend(
                feats, torch.zeros(b - a, dtype=torch.long, device=target.device), rows=slice(a, b)
            )
        a = b
    return first


# ---------------------------------------------------------------- the loops


@dataclass
class _Row:
    """The host's record of one prompt of the batch."""

    prompt_len: int
    max_len: int  # prompt + max_new_tokens
    ids: list[int]
    start: int  # the anchor's position
    lengths: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    done: bool = False
    decode_s: float | None = None  # from the prefill's end until the read that found it finished
    counted: int = 0  # new tokens already reported to the progress callback

    def report(self, on_tokens: OnTokens | None, max_new: int) -> None:
        now = max_new if self.done else min(len(self.ids) - self.prompt_len, max_new)
        if on_tokens is not None and now > self.counted:
            on_tokens(now - self.counted)
        self.counted = now


def _compact(
    live: list[int],
    rows: list[_Row],
    parts: Sequence,
    state: list[torch.Tensor],
    device: torch.device,
) -> tuple[list[int], list[torch.Tensor]]:
    """Keep the live rows of every cache (`parts`: objects with `keep`) and state tensor, when at
    most COMPACT_AT of the batch still decodes; -> (batch index -> row, the state tensors)."""
    keep = [b for b, r in enumerate(live) if not rows[r].done]
    if not keep or len(keep) > COMPACT_AT * len(live):
        return live, state
    index = torch.tensor(keep, device=device)
    for part in parts:
        part.keep(index)
    return [live[b] for b in keep], [t[index] for t in state]


@torch.inference_mode()
def speculative_generate_batch(
    target: BatchedTarget,
    drafter: BatchedDrafter,
    prompts: Sequence[Sequence[int]],
    *,
    block_size: int,
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    on_tokens: OnTokens | None = None,
) -> list[Decoded]:
    """Greedy speculative decoding of every prompt at once, as `speculative_generate` decodes each
    alone. Each prompt's `decode_s` is the batch's time from the end of the prefill to the end of
    the cycle that finished it; `prefill_s` is the batch's prefill."""
    device, n = target.device, len(prompts)
    # a row's last block may start just below its limit, and a finished row (frozen) runs once more
    length = max(map(len, prompts)) + max_new_tokens + 2 * block_size
    target.start(n, length)
    drafter.start(prompts, length)
    t0 = target.clock()
    anchors = prefill(target, drafter, prompts)  # [N]
    rows = [
        _Row(len(p), len(p) + max_new_tokens, list(p) + [t], len(p))
        for p, t in zip(prompts, anchors.tolist())
    ]
    t1 = target.clock()
    starts = torch.tensor([len(p) for p in prompts], device=device)  # [N] anchor positions
    moving = torch.ones(n, dtype=torch.long, device=device)  # 0 freezes a finished row
    offsets = torch.arange(block_size, device=device)
    live = list(range(n))  # batch index -> row
    while live:
        drafts = drafter.propose_block(anchors, starts, block_size - 1).to(device)  # [n, B-1]
        # UNVERIFIED drafts (a confidence schedule's) go to the target as any token and match none
        block = torch.cat([anchors[:, None], drafts.clamp(min=0)], dim=1)  # [n, B]
        # [n, B, V], [n, B, K*H]
        logits, feats = target.forward(block, starts[:, None] + offsets, features=True)
        choice = logits.argmax(-1)  # [n, B]; an accepted draft equals the target's choice there
        accepted = (drafts == choice[:, :-1]).long().cumprod(1).sum(1)  # [n]
        drafter.extend(feats, starts)
        starts = starts + (accepted + 1) * moving
        anchors = torch.where(moving.bool(), choice.gather(1, accepted[:, None])[:, 0], anchors)
        host = torch.cat([accepted[:, None], choice], dim=1).tolist()  # the cycle's one sync
        now, finished = time.perf_counter(), False
        for b, r in enumerate(live):
            row = rows[r]
            if row.done:
                continue
            new = host[b][1 : host[b][0] + 2]  # the accepted drafts and the target's own token
            # the anchor counts: the prefill's token may be a stop token
            stopped = any(t in stop_ids for t in [row.ids[row.start], *new])
            row.ids.extend(new)
            row.starts.append(row.start)
            row.lengths.append(len(new))  # uncut, as the authors' loop counts
            row.start += len(new)
            row.done = stopped or row.start >= row.max_len
            if row.done:
                row.decode_s, finished = now - t1, True
            row.report(on_tokens, max_new_tokens)
        if finished:
            if all(rows[r].done for r in live):
                break
            live, (starts, anchors) = _compact(
                live, rows, (target, drafter), [starts, anchors], device
            )
            moving = torch.tensor([0 if rows[r].done else 1 for r in live], device=device)
    out = []
    for row in rows:
        tokens, _ = _cut_at_stop(row.ids[row.prompt_len : row.max_len], stop_ids)
        emitted = emitted_lengths(row.starts, row.lengths, row.prompt_len + len(tokens))
        out.append(Decoded(tokens, row.lengths, t1 - t0, row.decode_s, emitted))
    return out


@torch.inference_mode()
def target_generate_batch(
    target: BatchedTarget,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    on_tokens: OnTokens | None = None,
) -> list[Decoded]:
    """The target alone, greedy, every prompt at once, one token per row per forward: the batched
    loop's speed baseline and lossless reference, as `target_generate` is the one-at-a-time loop's.
    The tokens are read back every CHECK_EVERY steps at most; a prompt's `decode_s` ends at the read
    that found it finished."""
    device, n = target.device, len(prompts)
    target.start(n, max(map(len, prompts)) + max_new_tokens)  # every fed slot is below P + max_new
    t0 = target.clock()
    tokens = prefill(target, None, prompts)  # [N]
    rows = [
        _Row(len(p), len(p) + max_new_tokens, list(p) + [t], len(p))
        for p, t in zip(prompts, tokens.tolist())
    ]
    t1 = target.clock()
    positions = torch.tensor([len(p) for p in prompts], device=device)  # of each row's newest token
    live = list(range(n))
    for row in rows:
        row.done = len(row.ids) - row.prompt_len >= max_new_tokens or row.ids[-1] in stop_ids
        row.decode_s = 0.0 if row.done else None  # the prefill's token was all it had to decode
        row.report(on_tokens, max_new_tokens)
    while not all(rows[r].done for r in live):
        live, (positions, tokens) = _compact(live, rows, (target,), [positions, tokens], device)
        steps = []
        for _ in range(
            min(
                CHECK_EVERY,
                max(rows[r].max_len - len(rows[r].ids) for r in live if not rows[r].done),
            )
        ):
            logits, _ = target.forward(tokens[:, None], positions[:, None], features=False)
            tokens, positions = logits[:, 0].argmax(-1), positions + 1
            steps.append(tokens)
        host = torch.stack(steps, dim=1).tolist()  # one sync per CHECK_EVERY steps
        now = time.perf_counter()
        for b, r in enumerate(live):
            row = rows[r]
            for t in host[b]:
                if row.done:
                    break
                row.ids.append(t)
                row.done = len(row.ids) >= row.max_len or t in stop_ids
            if row.done and row.decode_s is None:
                row.decode_s = now - t1
            row.report(on_tokens, max_new_tokens)
    return [Decoded(row.ids[row.prompt_len :], [], t1 - t0, row.decode_s) for row in rows]


# ---------------------------------------------------------------- the DFlash drafter, batched


class BatchedDFlash:
    """A DFlash-family drafter behind `BatchedDrafter`: its context keys/values per draft layer in
    buffers [N, kv heads, length, D] indexed by position (the target's scheme), the block drafted
    for every row at once, and the draft step of the one-at-a-time proposer
    (`DFlashProposer.draft`): block hidden states [N, B, H] and the anchors [N] -> drafts (DFlash2's
    selector walk included), which a drafter with another draft step (DSpark) replaces there, for
    both loops.

    The block's own keys/values are written at the block's positions too, past every committed slot:
    the next cycle's context overwrites them. A block query at position q sees slot j iff j lies
    before the block's end and the layer's rule allows it (causal: j <= q; window w: q - j < w, and
    j - q < w when not causal), the rule `dense_attend` applies to one block."""

    def __init__(self, proposer: DFlashProposer):
        self.proposer = proposer
        self.drafter = proposer.drafter
        self.block_size = proposer.block_size
        self.layer_ids = proposer.layer_ids
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots: torch.Tensor | None = None

    def start(self, prompts: Sequence[Sequence[int]], length: int) -> None:
        cfg, weight = self.drafter.cfg, self.drafter.fc.weight
        shape = (len(prompts), cfg.num_key_value_heads, length, cfg.head_dim)
        self.keys = [weight.new_zeros(shape) for _ in self.drafter.layers]
        self.values = [weight.new_zeros(shape) for _ in self.drafter.layers]
        self.slots = torch.arange(length, device=weight.device)

    def keep(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]

    def _write(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: slice
    ) -> None:
        """k, v [n, T, kv heads, D] into slots positions [n, T] of rows `rows`."""
        index = positions[:, None, :, None].expand(-1, k.shape[2], -1, k.shape[3])  # [n, h, T, D]
        self.keys[layer][rows].scatter_(2, index, k.transpose(1, 2))
        self.values[layer][rows].scatter_(2, index, v.transpose(1, 2))

    @torch.inference_mode()
    def extend(
        self, context: torch.Tensor, starts: torch.Tensor, rows: slice = slice(None)
    ) -> None:
        d = self.drafter
        n, t = context.shape[:2]
        ctx = d.fuse_context(context.flatten(0, 1).to(d.fc.weight.dtype))  # [n*T, K*H] -> [n*T, H]
        positions = starts[:, None] + torch.arange(t, device=starts.device)  # [n, T]
        rope = d.rotary(positions.flatten())
        for i, layer in enumerate(d.layers):
            k, v = layer.self_attn.context_kv(ctx, rope)  # [n*T, kv heads, D] each
            self._write(i, positions, k.unflatten(0, (n, t)), v.unflatten(0, (n, t)), rows)

    def _masks(self, positions: torch.Tensor, end: torch.Tensor) -> dict:
        """The block's positions [N, b] and end [N] -> per layer mode the mask [N, 1, b, length]."""
        q_pos, slots = positions[:, None, :, None], self.slots
        seen = slots < end[:, None, None, None]  # the committed context and the block itself
        masks = {}
        for window, causal in {
            self.drafter.cfg.layer_mode(i) for i in range(len(self.drafter.layers))
        }:
            mask = seen & (slots <= q_pos) if causal else seen
            if window is not None:
                mask = mask & (q_pos - slots < window) & (causal | (slots - q_pos < window))
            masks[(window, causal)] = mask
        return masks

    def _attend(self, layer: int, positions: torch.Tensor, masks: dict):
        """A draft layer's `Attend` over its buffers, the block's own keys/values written first."""
        n, b = positions.shape
        scale = self.drafter.cfg.head_dim**-0.5

        def attend(q, k, v, mode):  # q [n*b, heads, D]; k, v [n*b, kv heads, D]: the block's own
            self._write(
                layer, positions, k.unflatten(0, (n, b)), v.unflatten(0, (n, b)), slice(None)
            )
            keys, values = self.keys[layer], self.values[layer]
            out = F.scaled_dot_product_attention(  # [n, heads, b, D]
                q.unflatten(0, (n, b)).transpose(1, 2),
                keys.to(q.dtype),
                values.to(q.dtype),
                attn_mask=masks[mode],
                scale=scale,
                enable_gqa=q.shape[1] != keys.shape[1],
            )
            return out.transpose(1, 2).flatten(0, 1)  # [n*b, heads, D]

        return attend

    @torch.inference_mode()
    def block_hidden(self, anchors: torch.Tensor, starts: torch.Tensor, size: int) -> torch.Tensor:
        """Blocks [anchor, MASK x (size-1)] at positions starts.. -> hidden states [N, size, H]
        (after norm)."""
        d = self.drafter
        n = anchors.shape[0]
        positions = starts[:, None] + torch.arange(size, device=starts.device)  # [N, b]
        ids = torch.full((n, size), d.cfg.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        x = d.embed(ids).flatten(0, 1)  # [N*b, H]
        rope = d.rotary(positions.flatten())
        masks = self._masks(positions, starts + size)
        # no context keys/values: they are in the buffers
        empty = x.new_zeros(0, d.cfg.num_key_value_heads, d.cfg.head_dim)
        for i, layer in enumerate(d.layers):  # each row's block is whole: DFlash2 convolves in it
            attend = self._attend(i, positions, masks)
            x = layer(x, empty, empty, rope, attend, d.cfg.layer_mode(i), size)
        return d.norm(x).unflatten(0, (n, size))

    @torch.inference_mode()
    def propose_block(
        self, anchors: torch.Tensor, starts: torch.Tensor, num_drafts: int
    ) -> torch.Tensor:
        # the block's rows: DFlash's anchor row is no prediction (B rows, B-1 drafts), DSpark's is
        rows = num_drafts + 1 - self.proposer.anchor_predicts
        hidden = self.block_hidden(anchors, starts, rows)
        drafts = self.proposer.draft(hidden, anchors)
        if self.proposer.confidence_threshold <= 0:
            return drafts
        verified = self.proposer.verified(hidden, anchors, drafts)  # [N]
        keep = torch.arange(drafts.shape[1], device=drafts.device) < verified[:, None]
        return torch.where(keep, drafts, UNVERIFIED)


def as_batched(drafter) -> BatchedDrafter:
    """A drafter's batched form: itself if it is one; the DFlash family's via `BatchedDFlash`."""
    if hasattr(drafter, "propose_block"):
        return drafter
    why = drafter_refusal(drafter)
    if why is not None:
        raise TypeError(f"{why}; decode with generation.batch_size = 1")
    return BatchedDFlash(drafter)


def batchable(drafter) -> bool:
    return drafter_refusal(drafter) is None


def drafter_refusal(drafter) -> str | None:
    """Why `drafter` has no batched form (None when it has)."""
    if hasattr(drafter, "propose_block") or isinstance(drafter, DFlashProposer):
        return None
    return f"the drafter ({type(drafter).__name__}) has no batched form"


# Rows a batch takes when generation.batch_size is 0 (auto) on a GPU, if memory allows.
AUTO_ROWS = 256


def rows_that_fit(model, drafter, length: int, block_size: int, share: float = 0.5) -> int:
    """How many rows of `length` positions `share` of the GPU's free memory holds: both KV caches,
    and the verify forward's float32 logits and hidden states (every layer's, for the features)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return AUTO_ROWS
    t, elt = model.config.get_text_config(), next(model.parameters()).element_size()
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    per_slot = 2 * t.num_hidden_layers * t.num_key_value_heads * head_dim * elt
    inner = getattr(drafter, "drafter", None)  # a DFlash drafter's own context cache
    if inner is not None:
        per_slot += 2 * len(inner.layers) * inner.cfg.num_key_value_heads * inner.cfg.head_dim * elt
    per_row = length * per_slot + block_size * (
        2 * 4 * t.vocab_size + (t.num_hidden_layers + 1) * t.hidden_size * elt
    )
    # free, and what torch's allocator holds unused: it is ours to reuse
    free = torch.cuda.mem_get_info(device)[0]
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(1, int(free * share // per_row))
