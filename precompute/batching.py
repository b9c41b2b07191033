"""Token-budget batches of right-padded sequences for the target forward.

Why right padding (and no attention mask) rather than packed variable-length sequences:
- Correct for every backend. The target is causal, so with right padding a real token only ever
  attends to real tokens before it; the pads come after and change nothing, whatever the attention
  implementation (sdpa, flash, eager) or layer kind (linear-attention / convolution layers of hybrid
  targets such as Qwen3.5 scan left to right as well). Measured on the CPU with the tiny target: a
  sequence's states alone and right-padded in a batch agree to float32 rounding
  (tests/precompute/test_batching.py).
- Packing is correct only on some backends and architectures. transformers 5 isolates packed
  sequences (given per-sequence position ids) with sdpa only when no KV cache is in use, and then by
  building a dense [T, T] block mask over the batch's T tokens (4 GiB of mask at 64K tokens, and
  sdpa leaves its flash kernel); flash-attention varlen handles it well, but linear-attention layers
  of hybrid targets ignore the boundaries (a leak of 0.4 on a tiny Qwen3.5-style target; see
  benchmarks/precompute_batching.py). Right padding needs none of it.
- Passing no attention mask keeps sdpa/flash on their causal fast paths (a mask forces the slower
  masked kernels).
The price is the padding itself; sorting by length within a sort window of work units before
cutting the batches keeps it small (benchmarks/precompute_batching.py prints the padding fraction).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices into `lengths`, longest first, cut so that len(batch) x longest <= token_budget.

    Longest first: the biggest batch runs first, so a budget the GPU cannot hold fails at once, not
    hours in. Ties keep input order, so batches are deterministic. A sequence longer than the budget
    gets a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pad_right(seqs: Sequence[np.ndarray], pad_id: int) -> torch.Tensor:
    """Token id arrays -> int64 [B, S_max], each sequence at the left, `pad_id` after it."""
    longest = max(len(s) for s in seqs)
    out = np.full((len(seqs), longest), pad_id, dtype=np.int64)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = seq
    return torch.from_numpy(out)


def unpad(states: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """[B, S, H] -> B views [L_b, H]: the real positions of each row."""
    return [states[b, :n] for b, n in enumerate(lengths)]


def padding_fraction(lengths: Sequence[int], batches: list[list[int]]) -> float:
    """Share of the forward's token slots that hold padding."""
    slots = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1.0 - sum(lengths) / slots if slots else 0.0
