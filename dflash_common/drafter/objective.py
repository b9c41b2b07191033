"""The DFlash training objective on a packed batch: where blocks start, what they predict, how much
each prediction weighs, and the acceptance-length (tau) estimate from per-position correctness.

- Anchors: drawn without replacement among loss-mask (response) positions of each sequence, at
  most `max_anchors` per sequence, from a seeded generator; the caller draws again every epoch.
  Rule 'block' (the paper's bound): p <= S - B, so the whole block lies inside the sequence.
  Rule 'label' (SpecForge's): p <= S - 2 and p + 1 is a response token, i.e. at least one valid
  label; labels past the end weigh zero, so the last tokens of a response (end of turn included)
  are also learnt at block position 1, and an end of turn followed by a user turn is no anchor.
- Labels: block position k predicts the token at anchor + k: *same position, no shift*. Position 0
  (the anchor, which the block is given) is not a prediction.
- Weights: exp(-(k - 1) / gamma) for k >= 1; zero at k = 0, past the sequence end and outside the
  loss mask. Labels with zero weight are IGNORE_INDEX. Or D-PACE (arXiv 2605.18810), from the
  drafter's own detached per-position cross-entropy: `dpace_weights`. Optionally the blocks that
  greedy serving would draft (`serving_path`) weigh (1 + path_weight) times more.
- Tau estimate: per block, accepted = leading correct predictions from k = 1 (a position that is not
  a valid prediction ends the run, as the served draft would stop there); tau = 1 + mean accepted.
  The trainer's validation and the eval's offline estimate both use `AcceptanceCounts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from dflash_common.drafter.packed import sequence_index, sequence_starts

AnchorRule = Literal["block", "label"]

IGNORE_INDEX = -100  # F.cross_entropy's default ignore label

# Published gamma per block size (DFlash paper): B=16 -> 7, B=10 -> 5, B=8 -> 4.
_PUBLISHED_GAMMA = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_gamma(block_size: int) -> float:
    """The published gamma for B in {8, 10, 16}; other sizes interpolate linearly between the
    published points (extrapolating with the nearest segment's slope), floored at 1."""
    (b0, g0), (b1, g1), (b2, g2) = _PUBLISHED_GAMMA
    if block_size > b1:
        (b0, g0), (b1, g1) = (b1, g1), (b2, g2)
    return max(1.0, g0 + (g1 - g0) * (block_size - b0) / (b1 - b0))


def sample_anchors(
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    max_anchors: int,
    generator: torch.Generator,
    rule: AnchorRule = "block",
) -> torch.Tensor:
    """Packed anchor positions int64 [A] (sorted): per sequence, up to `max_anchors` distinct
    positions of the bool mask `loss_mask` [T] eligible by `rule` (see the module docstring),
    uniformly at random from `generator` (deterministic for a seed)."""
    device, mask, cu = loss_mask.device, loss_mask, cu_seqlens
    total = loss_mask.shape[0]
    tokens = torch.arange(total, device=device)
    seq = sequence_index(cu, tokens)  # [T]
    if rule == "block":
        eligible = mask & (tokens <= cu[seq + 1] - block_size)  # p <= S - B, local
    elif rule == "label":
        next_in_mask = torch.cat([mask[1:], mask.new_zeros(1)])  # loss_mask[p + 1]
        eligible = mask & next_in_mask & (tokens <= cu[seq + 1] - 2)  # p + 1 inside the sequence
    else:
        raise ValueError(f"anchor rule {rule!r} unknown; use 'block' or 'label'")
    keys = torch.rand(total, generator=generator, device=generator.device, dtype=torch.float64).to(device)
    keys = torch.where(eligible, keys, 2.0)  # ineligible positions sort last in their sequence
    order = torch.argsort(seq.double() * 4.0 + keys)  # grouped by sequence, random within
    rank = torch.empty_like(order)
    rank[order] = tokens - cu[seq[order]]  # rank of each position in its sequence's random order
    return tokens[eligible & (rank < max_anchors)]


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    gamma: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """labels int64 [A, B] (token at anchor + k, IGNORE_INDEX where not a prediction) and float32
    weights [A, B] = exp(-(k - 1) / gamma), zero at k = 0, past the sequence end, outside the mask."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    k = torch.arange(block_size, device=anchors.device)
    pos = anchors[:, None] + k  # [A, B] packed positions, same position (no shift)
    end = cu_seqlens[sequence_index(cu_seqlens, anchors) + 1][:, None]  # [A, 1] its sequence's end
    inside = pos < end
    safe = pos.clamp(max=input_ids.shape[0] - 1)
    valid = inside & loss_mask[safe] & (k >= 1)
    labels = torch.where(valid, input_ids[safe], IGNORE_INDEX)
    decay = torch.exp(-(k - 1).clamp(min=0).float() / gamma)  # [B]
    weights = torch.where(valid, decay, 0.0)
    return labels, weights


def dpace_weights(row_ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [A, B] (float32, no gradient) from the drafter's own per-position
    cross-entropy row_ce [A, B] and the prediction mask valid [A, B] (False at k = 0):

        q_k = exp(-CE_k)                       the draft's probability of the label at k
        q~_k = alpha + (1 - alpha) q_k         where valid, else 1
        C_k = prod_{j <= k} q~_j               a soft chance that drafts 1..k are all accepted
        w_k = valid_k * sum_{j >= k} valid_j C_j

    so a position weighs what its acceptance buys downstream, and the fixed gamma decay is dropped."""
    q = torch.exp(-row_ce.detach().float())
    q_soft = torch.where(valid, alpha + (1.0 - alpha) * q, torch.ones_like(q))
    reach = torch.cumprod(q_soft, dim=1) * valid  # [A, B]: valid_j C_j
    tail = reach.flip(1).cumsum(1).flip(1)  # [A, B]: sum over j >= k
    return tail * valid


def accepted_drafts(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per block [A] (long): leading correct predictions from k = 1 (argmax == label; a position that
    is not a valid prediction ends the run), the drafts greedy verification would accept."""
    hit = (correct & valid)[:, 1:]  # position 0 is the anchor, never a prediction
    return torch.cumprod(hit.long(), dim=1).sum(1)


def response_starts(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """bool [T]: True at the first position of every response, a response being a maximal run of
    loss-mask positions inside one sequence (train/path_tau.py decodes each alone)."""
    # a run never crosses a sequence boundary
    is_start = sequence_starts(cu_seqlens, loss_mask.shape[0])
    prev = torch.cat([loss_mask.new_zeros(1), loss_mask[:-1]])
    return loss_mask & (~prev | is_start)


def response_ids(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per packed position int64 [T]: the number of the response it lies in (`response_starts`);
    meaningful at loss-mask positions only."""
    return response_starts(loss_mask, cu_seqlens).long().cumsum(0)


def serving_path(anchors: torch.Tensor, accepted: torch.Tensor, loss_mask: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Which blocks [A] (bool) greedy speculative decoding would draft, from anchors [A] (packed,
    sorted, on loss-mask positions) and each block's accepted drafts [A] (`accepted_drafts`).

    Per response the path starts at its first anchor (the first response position when it is one)
    and goes on as serving does, a -> a + accepted(a) + 1: the token after the accepted drafts is the
    target's correction, the next block's anchor. Where that position is no anchor this step (a
    sequence with more response positions than max_anchors), the path goes on at the first anchor at
    or after it; past the response's last anchor it ends. So every block after the first is one the
    drafter reaches after a rejection.

    No host sync, no loop over positions: pointer doubling over the anchors, log2(A) rounds, each
    pushing the marks one jump further and squaring the jumps (a sink after the last anchor absorbs
    the ends)."""
    n = anchors.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=anchors.device)
    a = anchors
    response = response_ids(loss_mask, cu_seqlens)[a]  # [A]
    nxt = torch.searchsorted(a, a + accepted + 1)  # [A] first anchor at or after, n if none
    inside = (nxt < n) & (response[nxt.clamp(max=n - 1)] == response)
    sink = torch.full((1,), n, dtype=torch.long, device=a.device)
    jump = torch.cat([torch.where(inside, nxt, n), sink])  # [A + 1]
    first = torch.ones(n, dtype=torch.bool, device=a.device)
    first[1:] = response[1:] != response[:-1]
    on = torch.cat([first, first.new_zeros(1)])  # [A + 1]: the path's starts
    for _ in range((n - 1).bit_length() or 1):  # after r rounds: all within 2^r - 1 jumps (a path has <= n blocks)
        pushed = torch.zeros(n + 1, dtype=torch.int32, device=a.device).index_add_(0, jump, on.int())
        on = on | (pushed > 0)
        jump = jump[jump]
    return on[:n]


@dataclass
class AcceptanceCounts:
    """Sums that add over batches and ranks: per block position, valid predictions and correct ones;
    accepted drafts over all blocks; blocks with at least one valid prediction."""

    correct: torch.Tensor  # [B] float64
    valid: torch.Tensor  # [B] float64
    accepted: float
    blocks: float

    @classmethod
    def from_blocks(cls, correct: torch.Tensor, valid: torch.Tensor) -> "AcceptanceCounts":
        """correct, valid: bool [A, B] (argmax == label; label is a prediction)."""
        accepted = accepted_drafts(correct, valid)
        has_any = valid[:, 1:].any(1)
        return cls(
            correct=(correct & valid).sum(0).double().cpu(),
            valid=valid.sum(0).double().cpu(),
            accepted=float(accepted[has_any].sum()),
            blocks=float(has_any.sum()),
        )

    def __add__(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        return AcceptanceCounts(self.correct + other.correct, self.valid + other.valid,
                                self.accepted + other.accepted, self.blocks + other.blocks)

    def to_tensor(self) -> torch.Tensor:
        """One float64 vector (for a single all_reduce): [correct (B), valid (B), accepted, blocks]."""
        return torch.cat([self.correct, self.valid, torch.tensor([self.accepted, self.blocks], dtype=torch.float64)])

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "AcceptanceCounts":
        b = (t.numel() - 2) // 2
        t = t.double().cpu()
        return cls(t[:b], t[b:2 * b], float(t[2 * b]), float(t[2 * b + 1]))

    @property
    def per_position_accuracy(self) -> torch.Tensor:
        """[B] accuracy at each block position (NaN where no valid prediction; always at k = 0)."""
        return self.correct / self.valid

    @property
    def accuracy(self) -> float:
        valid = float(self.valid.sum())
        return float(self.correct.sum()) / valid if valid else math.nan

    @property
    def tau(self) -> float:
        """Estimated acceptance length: 1 + mean accepted drafts per block."""
        return 1.0 + self.accepted / self.blocks if self.blocks else math.nan
