"""Where a packed batch's blocks sit (`BlockLayout`), the sparse attention mask built from it, and the
attention backends the drafter's layers call.

The training forward runs many blocks of many packed sequences at once under a sparse mask built
from the anchors: a block's queries see the context of their own sequence strictly before the
anchor, their own block and nothing else. Inside the block a `full_attention` layer is
bidirectional and a `sliding_attention` layer is causal (k_pos <= q_pos), with its keys capped
by the sliding window (`q_pos - k_pos < sliding_window`): the rule vLLM (`_dflash_layer_causal`),
SGLang (sliding layers are DECODER attention) and the DFlash authors serve such layers by.

Backends, each an `Attend` over the layer's mode (sliding window, causal):
- flex (`block_attend` on the GPU): `flex_attention` with a BlockMask whose tile tables are computed
  from the intervals each query row sees (never a dense [Q, KV] mask), compiled on the GPU.
- chunked (`block_attend` on the CPU): SDPA over chunks of query rows, masks from the same intervals.
- dense (`dense_attend`): one drafted block over its cached context (speculative decoding).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

from dflash_common.drafter.packed import sequence_index

# flex_attention's default sparse tile (rows x columns of the score matrix per BlockMask entry).
FLEX_TILE = 128

# A draft layer's attention rule: (sliding window or None, causal inside the block).
LayerMode = tuple[int | None, bool]
# attend(q [R, nh, D], k [KV, nkv, D], v [KV, nkv, D], mode) -> [R, nh, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LayerMode], torch.Tensor]


@dataclass(frozen=True)
class BlockLayout:
    """The blocks of a packed batch. Query row r is block r // B, offset r % B; key column c < T is
    context position c (packed), c >= T is block key (c - T) // B, offset (c - T) % B."""

    anchors: torch.Tensor  # [A] packed positions of the anchors
    starts: torch.Tensor  # [A] packed start of each anchor's sequence
    positions: torch.Tensor  # [T] position of every packed token within its own sequence
    total: int  # T
    block_size: int  # B

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, anchors: torch.Tensor, total: int, block_size: int) -> "BlockLayout":
        """cu_seqlens int64 [N+1] and anchors int64 [A] (dflash_common/drafter/packed.py)."""
        tokens = torch.arange(total, device=anchors.device)
        seq_of_token = sequence_index(cu_seqlens, tokens)  # [T]
        seq_of_anchor = sequence_index(cu_seqlens, anchors)  # [A]
        starts = cu_seqlens[seq_of_anchor]
        return cls(anchors, starts, tokens - cu_seqlens[seq_of_token], total, block_size)

    def block_positions(self) -> torch.Tensor:
        """[A, B] absolute positions anchor..anchor+B-1 within each block's sequence."""
        offsets = torch.arange(self.block_size, device=self.anchors.device)
        return self.positions[self.anchors][:, None] + offsets

    def mask_mod(self, sliding_window: int | None, causal: bool = False):
        """flex_attention mask_mod: context of the same sequence strictly before the anchor and the
        own block, bidirectionally or (`causal`) up to the query; with a sliding window,
        q_pos - k_pos < sliding_window (and k_pos - q_pos < sliding_window when bidirectional)."""
        anchors, starts, b = self.anchors, self.starts, self.block_size
        # the closure reads it as `window`: under the name `sliding_window` inductor's C++ flex
        # template for the CPU emits code that does not compile (torch 2.13: `cur_kvSplitSize4`
        # undeclared)
        window = sliding_window
        # first key column of each block's own keys, as a tensor: a compiled kernel then does not
        # specialise on the batch's token count
        block0 = self.total + torch.arange(anchors.shape[0], device=anchors.device) * b  # [A]

        def visible(batch, head, q, kv):
            j, k = q // b, q % b
            anchor = anchors[j]
            in_ctx = (kv >= starts[j]) & (kv < anchor)  # kv < anchor < T: a context column
            rel = kv - block0[j]  # offset inside block j's keys
            in_block = (rel >= 0) & (rel < b)
            if window is not None:
                in_ctx = in_ctx & (anchor + k - kv < window)
                in_block = in_block & (k - rel < window) & (causal or rel - k < window)
            if causal:
                in_block = in_block & (rel <= k)  # a sliding layer's block: the query and what precedes it
            return in_ctx | in_block

        return visible

    def row_intervals(self, sliding_window: int | None,
                      causal: bool = False) -> tuple[torch.Tensor, ...]:
        """Per query row, the key columns it sees as two half-open intervals (context, block):
        (ctx_lo, ctx_hi, blk_lo, blk_hi), each [A*B]; the same set as `mask_mod`."""
        b = self.block_size
        k = torch.arange(b, device=self.anchors.device)
        anchor, start = self.anchors[:, None], self.starts[:, None]  # [A, 1]
        block0 = self.total + torch.arange(self.anchors.shape[0], device=k.device)[:, None] * b  # [A, 1]
        ctx_lo, ctx_hi = start.expand(-1, b), anchor.expand(-1, b)
        blk_lo, blk_hi = block0.expand(-1, b), (block0 + b).expand(-1, b)
        if sliding_window is not None:
            ctx_lo = torch.maximum(ctx_lo, anchor + k - sliding_window + 1)
            blk_lo = block0 + (k - sliding_window + 1).clamp(min=0)
            blk_hi = block0 + (k + sliding_window).clamp(max=b)
        if causal:
            blk_hi = torch.minimum(blk_hi, block0 + k + 1)
        return tuple(x.flatten() for x in (ctx_lo, ctx_hi, blk_lo, blk_hi))

    def block_mask(self, sliding_window: int | None, causal: bool = False,
                   tile: int = FLEX_TILE) -> BlockMask:
        """The sparse BlockMask, its tile tables computed from `row_intervals` in chunks of rows
        (no dense [Q, KV] mask is ever built)."""
        q_len = self.anchors.shape[0] * self.block_size
        kv_len = self.total + q_len
        intervals = self.row_intervals(sliding_window, causal)
        partial, full = _tile_tables(intervals, q_len, kv_len, tile)
        return BlockMask.from_kv_blocks(
            *_tables_to_indices(partial), *_tables_to_indices(full),
            BLOCK_SIZE=tile, mask_mod=self.mask_mod(sliding_window, causal),
            seq_lengths=(q_len, kv_len),
        )


# Rows x column-tiles evaluated at once when building tile tables (bounds temporary memory).
_TILE_TABLE_CHUNK = 1 << 24


def _tile_tables(intervals, q_len: int, kv_len: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) bool [Q_tiles, KV_tiles]: tiles some / every query row sees entirely.

    A tile is full when every row of the q tile covers all its columns with one interval; rows and
    columns past the ends count as masked (as create_block_mask pads), so edge tiles are partial."""
    device = intervals[0].device
    n_q, n_kv = -(-q_len // tile), -(-kv_len // tile)
    pad = n_q * tile - q_len
    # padding rows see nothing: empty intervals
    lo_hi = [F.pad(x, (0, pad), value=0) for x in intervals]
    col_lo = torch.arange(n_kv, device=device) * tile  # [KVt]
    col_hi_clip = (col_lo + tile).clamp(max=kv_len)
    col_whole = col_lo + tile <= kv_len  # a tile past kv_len is never full
    rows_per_chunk = max(tile, (_TILE_TABLE_CHUNK // max(n_kv, 1)) // tile * tile)
    any_parts, full_parts = [], []
    for r0 in range(0, n_q * tile, rows_per_chunk):
        ctx_lo, ctx_hi, blk_lo, blk_hi = (x[r0:r0 + rows_per_chunk, None] for x in lo_hi)  # [r, 1]
        seen = _overlaps(ctx_lo, ctx_hi, col_lo, col_hi_clip) | _overlaps(blk_lo, blk_hi, col_lo, col_hi_clip)
        whole = ((ctx_lo <= col_lo) & (col_lo + tile <= ctx_hi)) | ((blk_lo <= col_lo) & (col_lo + tile <= blk_hi))
        whole = whole & col_whole  # padding rows have empty intervals: their tile is never full
        any_parts.append(seen.unflatten(0, (-1, tile)).any(1))
        full_parts.append(whole.unflatten(0, (-1, tile)).all(1))
    seen, full = torch.cat(any_parts), torch.cat(full_parts)  # [Qt, KVt]
    return seen & ~full, full


def _overlaps(lo, hi, col_lo, col_hi):
    return torch.maximum(lo, col_lo) < torch.minimum(hi, col_hi)


def _tables_to_indices(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [Qt, KVt] -> (num_blocks [1, 1, Qt], indices [1, 1, Qt, KVt]) with listed tiles first."""
    counts = table.sum(-1, dtype=torch.int32)
    order = torch.argsort((~table).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None], order[None, None]


_compiled_flex: Callable | None = None
# Always the main flex kernel: without grad and with fewer than 128 query rows (a few blocks, e.g. the
# last rounds of a path-tau replay), inductor picks its flex-decoding kernel, which finds no valid
# config for our BlockMask under dynamic shapes (it raises NoValidChoicesError).
# Not ROWS_GUARANTEED_SAFE: the padding rows of the last query tile see no key, and without the
# kernel's guard their NaNs reach every key's gradient (the loss is NaN from the first step).
_FLEX_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}


def _flex_fn(device: torch.device) -> Callable:
    """flex_attention compiled on the GPU (its fast sparse kernel); eager elsewhere (tests)."""
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        # default dynamic=None: a second batch shape marks lengths dynamic instead of recompiling per shape
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


FLEX_ON_CPU = False  # tests set it to run the flex path (eager or inductor-compiled) on the CPU too
# The CPU path's chunks: query rows at most, and scores one chunk may hold (x 4 bytes), at any batch size.
_CPU_ROWS_PER_CHUNK = 1024
_CPU_SCORES_PER_CHUNK = 1 << 25


def block_attend(layout: "BlockLayout", modes: set[LayerMode], head_dim: int, device: torch.device) -> Attend:
    """The blocks' sparse attention: compiled flex on the GPU; on the CPU, dense attention over chunks
    of query rows, whose masks come from the same row intervals (flex's eager CPU path materialises
    every score of the batch at once: ~17 GiB for one validation batch of the quality benchmark)."""
    if device.type == "cuda" or FLEX_ON_CPU:
        return _flex_attend({m: layout.block_mask(*m) for m in modes}, head_dim)
    return _chunked_attend({m: layout.row_intervals(*m) for m in modes}, head_dim)


def _flex_attend(masks: dict[LayerMode, BlockMask], head_dim: int) -> Attend:
    def attend(q, k, v, mode):
        # [R, heads, D] -> [1, heads, R, D]
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
        gqa, scale, mask = q.shape[1] != k.shape[1], head_dim**-0.5, masks[mode]
        if q.device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            # flex_attention has no CPU backward: the same mask_mod, densified, through SDPA (tests only)
            dense = create_mask(mask.mask_mod, None, None, q.shape[2], k.shape[2], q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=gqa)
        else:
            with warnings.catch_warnings():  # eager on the CPU is intended (tests); say nothing
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                out = _flex_fn(q.device)(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa,
                                         kernel_options=_FLEX_OPTIONS if q.device.type == "cuda" else None)
        return out[0].transpose(0, 1)

    return attend


def _chunked_attend(intervals: dict[LayerMode, tuple[torch.Tensor, ...]], head_dim: int) -> Attend:
    """Attention of query rows over key columns given, per row, two visible intervals (context, block):
    SDPA with a boolean mask, a chunk of rows at a time, over only the key columns the chunk's intervals
    span (consecutive blocks share a sequence: a few hundred context columns and the chunk's own block
    keys, not the whole batch). Without grad (validation, the offline estimate) memory stays bounded at
    any batch size; with grad, autograd keeps every chunk for the backward."""

    def attend(q, k, v, mode):
        ctx_lo, ctx_hi, blk_lo, blk_hi = intervals[mode]  # [R] each
        heads, out, r0 = q.shape[1], [], 0
        while r0 < q.shape[0]:
            r1 = min(q.shape[0], r0 + _CPU_ROWS_PER_CHUNK)
            while True:  # fewer rows while the chunk's scores would pass the budget
                spans = [(int(lo[r0:r1].min()), int(hi[r0:r1].max())) for lo, hi in ((ctx_lo, ctx_hi), (blk_lo, blk_hi))]
                width = sum(max(0, b - a) for a, b in spans)
                if r1 - r0 == 1 or (r1 - r0) * heads * width <= _CPU_SCORES_PER_CHUNK:
                    break
                r1 = r0 + (r1 - r0) // 2
            cols = torch.cat([torch.arange(a, b, device=k.device) for a, b in spans])  # [W] key columns
            r = slice(r0, r1)
            mask = (((cols >= ctx_lo[r, None]) & (cols < ctx_hi[r, None]))
                    | ((cols >= blk_lo[r, None]) & (cols < blk_hi[r, None])))  # [rows, W]
            k_, v_ = (x[cols].transpose(0, 1)[None] for x in (k, v))  # [1, nkv, W, D]
            out.append(F.scaled_dot_product_attention(
                q[r].transpose(0, 1)[None], k_, v_, attn_mask=mask, scale=head_dim**-0.5,
                enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1))  # [rows, nh, D]
            r0 = r1
        return torch.cat(out)

    return attend


def dense_attend(context_len: int, block_len: int, head_dim: int) -> Attend:
    """Attention of one drafted block over [context (context_len), block (block_len)] keys: the
    whole context and block for full layers; for sliding layers, causally within the window."""

    def attend(q, k, v, mode):
        (sliding_window, causal), mask = mode, None
        if sliding_window is not None or causal:
            q_pos = context_len + torch.arange(block_len, device=q.device)[:, None]
            k_pos = torch.arange(context_len + block_len, device=q.device)[None, :]
            mask = torch.ones(block_len, context_len + block_len, dtype=torch.bool, device=q.device)  # [b, L+b]
            if sliding_window is not None:
                mask = ((q_pos - k_pos < sliding_window)
                        & (causal | (k_pos - q_pos < sliding_window)))
            if causal:
                mask = mask & (k_pos <= q_pos)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, scale=head_dim**-0.5, enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1)

    return attend
