"""A packed batch as the drafter's functions take it: several sequences laid end to end, no padding,
sequence n at packed positions [cu_seqlens[n], cu_seqlens[n+1]).

Its index tensors (input_ids, cu_seqlens, anchors) are int64 and its loss mask is bool, the dtypes
train/transfer.py's DeviceBatch delivers (its docstring says why); the functions of this package
take them so and convert nothing. The lookups below are the ones several of them share.
"""

from __future__ import annotations

import torch


def sequence_index(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The sequence each packed position lies in: cu_seqlens int64 [N+1], positions int64 [P] ->
    int64 [P]."""
    return torch.searchsorted(cu_seqlens, positions, right=True) - 1


def sequence_starts(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """bool [T]: True at the first position of every (non-empty) sequence of a batch of `total`
    tokens."""
    starts = torch.zeros(total, dtype=torch.bool, device=cu_seqlens.device)
    first = cu_seqlens[:-1]
    starts[first[first < total]] = True  # an empty last sequence starts at T: no position
    return starts
