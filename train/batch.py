"""A packed batch on the host, between the shard cache and the device feeder: the small arrays are
assembled, the hidden states still lie in the cache slots (train/data.py builds it, train/transfer.py
copies it to the device)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from train.cache import Handle


@dataclasses.dataclass
class ShardSlot:
    """A shard in its cache slot, the chosen layers in the drafter's order (views of the slot)."""

    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    offsets: np.ndarray  # int64 [N+1]
    # K (+1: the final state, last) x [T, row] stored bits in the storage integer dtype (uint16 for
    # bf16, uint8 otherwise: the dtype flow of dflash_common/store/quant.py)
    states: list[torch.Tensor]
    scales: list[torch.Tensor] | None  # K (+1) x float32 [T] (scaled dtypes)
    dtype: str = "bf16"  # the store's storage dtype


@dataclasses.dataclass
class HostBatch:
    """A packed batch on the host: small arrays assembled, states still in the cache slots."""

    epoch: int
    index: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 [T] (0/1)
    cu_seqlens: torch.Tensor  # int64 [N+1]
    anchors: torch.Tensor  # int64 [A]
    segments: list[tuple[int, int, int, int]]  # (shard slot index, source row, dest row, rows)
    shards: list[ShardSlot]
    handles: list[Handle]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    def take_handles(self) -> list[Handle]:
        """Hand over the cache handles (to whoever waits for the copies out of the slots)."""
        handles, self.handles = self.handles, []
        return handles

    def small_tensor(self) -> torch.Tensor:
        """ids, mask, anchors, cu_seqlens in one int64 vector: one copy to the device, not four."""
        return torch.cat([self.input_ids, self.loss_mask, self.anchors, self.cu_seqlens])

    def small_numel(self) -> int:
        return 2 * self.tokens + self.anchors.numel() + self.cu_seqlens.numel()

    def split_small(self, small: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, a = self.tokens, self.anchors.numel()
        return small[:t], small[t:2 * t], small[2 * t:2 * t + a], small[2 * t + a:2 * t + a + self.cu_seqlens.numel()]
