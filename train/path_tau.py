"""Path tau: greedy speculative decoding replayed from a store, without the target.

When a stored response is the target's own greedy output (as dflash-generate writes it), the
target's verdict on any draft is known in advance: at every response position its greedy token *is*
the stored token. So `train/eval/spec_decode.py`'s greedy decoding can be replayed exactly from the
stored tokens and features alone:

    prefill  -> the first response token r0 at position p (not a cycle)
    a = p; while a < end - 1:                 # a: the anchor, the last committed token
        drafts = drafter(block [token at a, MASK x (B-1)],
                         context = stored features at positions < a)
        accepted = leading drafts equal to the stored tokens at a+1, a+2, ...
        emitted = cycle_length(accepted, a, end)  # accepted + 1, cut at the end (the one end rule)
        a += emitted                          # the next anchor: the target's correction, stored

Every cycle drafts a whole block, as the real loop does, even where the block reaches past the
response's end (a shorter block would change the drafts: the block attends to itself both ways).
Each cycle counts `emitted` (accepted drafts + the target's own token) cut at the response's end,
and a cycle that would emit nothing before the end is not run: that is dflash-eval's
`Decoded.emitted`, so path tau equals dflash-eval's `tau_emitted` exactly. dflash-eval's `tau` (the
DFlash authors' count) differs from it only by the last cycle of each response, which it counts
uncut: drafts accepted past the stop token or the length limit count there, and a last cycle
anchored at the response's last token (it emits only past the limit, or follows a stop token from
the prefill) is one of tau's cycles but not of path tau's. That last cycle cannot be replayed: the
store holds the response only up to its stop token or the limit, so what the target would emit past
the end is unknown. A response's tau is therefore >= its path tau unless such an empty last cycle
accepted less than the response's mean.

A response is one contiguous run of loss-mask positions: each assistant turn of a conversation is
replayed as a prompt of its own, with everything stored before it as its prompt (as dflash-eval
decodes each turn). `max_new_tokens` (dflash-eval's generation.max_new_tokens, the prefill's token
included) ends a response at p + max_new_tokens.

Where the replay equals real decoding's `emitted` (the test in tests/train/test_path_tau.py
shows it):
- the response is the target's greedy continuation of the stored prompt, token for token (token ids,
  not re-tokenised text: a store of dflash-generate's answers holds each last answer's own ids),
  and it ends with a stop token or at p + max_new_tokens;
- the stored sequence up to p is the prompt dflash-eval renders (same chat template);
- the drafter sees the same features: the store holds them in bf16 (or fp8), dflash-eval hands over
  float32 ones, so the two agree exactly only when the real path's features are rounded the same
  way; otherwise near-tied draft argmaxes may differ.

One forward per round drafts one block for every sequence of a packed batch that is still decoding
(the training forward's sparse mask, one anchor per sequence); the context keys/values of the batch
are computed once and reused by every round.

    lengths = replay_batch(drafter, batch)          # per response: its cycles' emitted tokens
    counts = path_counts(lengths)                   # sums that add over batches and ranks
    summarize_path(counts)["path_tau"]
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dflash_common.drafter.attention import BlockLayout
from dflash_common.drafter.model import DFlashDrafter
from dflash_common.drafter.objective import response_starts
from dflash_common.drafter.packed import sequence_index
from train.transfer import DeviceBatch

# Blocks whose logits [n, B-1, V] are materialised at once (bounds memory at large vocabularies).
_LOGIT_ELEMENTS = 1 << 26


def cycle_length(accepted: torch.Tensor, anchor: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Tokens a cycle emits, as train/eval/spec_decode.py's `Decoded.emitted` counts them: the
    accepted drafts plus the target's own token, cut where the response ends (its stop token at
    end - 1, or the length limit), so the last cycle counts only what it emits
    (`acceptance_lengths`, the authors' tau, counts it uncut). The one place of the end rule: follow
    spec_decode's `emitted_lengths` if it changes."""
    return torch.minimum(accepted + 1, end - 1 - anchor)


def response_segments(
    loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, max_new_tokens: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The responses of a packed batch: maximal runs of loss-mask positions inside one sequence.

    Returns packed (first, end, seq_start) int64 [R] each: first response token, end of the response
    (exclusive, cut at first + max_new_tokens) and the start of its sequence."""
    begins = response_starts(loss_mask, cu_seqlens)  # [T]
    # a response ends where the next position does not continue it (no response, or another one)
    continues = torch.cat([loss_mask[1:] & ~begins[1:], loss_mask.new_zeros(1)])
    finishes = loss_mask & ~continues
    first = torch.nonzero(begins)[:, 0]
    end = torch.nonzero(finishes)[:, 0] + 1
    seq_start = cu_seqlens[sequence_index(cu_seqlens, first)]
    if max_new_tokens:
        end = torch.minimum(end, first + max_new_tokens)
    return first, end, seq_start


def _greedy_drafts(
    drafter: DFlashDrafter, hidden: torch.Tensor, first_tokens: torch.Tensor, num_drafts: int
) -> torch.Tensor:
    """Block hidden states [n, b, H], the anchors' tokens [n] -> greedy drafts [n, num_drafts]
    (drafter.greedy_drafts: b-1, position 0 being the anchor; a DSpark drafter's b; DFlash2's
    selector walk)."""
    n, b, _ = hidden.shape
    rows = max(1, _LOGIT_ELEMENTS // max(1, b * drafter.cfg.vocab_size))
    if not n:
        return hidden.new_zeros((0, num_drafts), dtype=torch.long)
    return torch.cat(
        [
            drafter.greedy_drafts(hidden[i : i + rows], first_tokens[i : i + rows])
            for i in range(0, n, rows)
        ]
    )


@torch.no_grad()
def replay_batch(
    drafter: DFlashDrafter,
    batch: DeviceBatch,
    *,
    block_size: int | None = None,
    max_new_tokens: int | None = None,
    autocast: str = "none",
) -> list[list[int]]:
    """Greedy speculative decoding of every response of a device batch (features, input_ids,
    loss_mask, cu_seqlens), replayed from its stored tokens: per response (in packed order) the
    tokens each cycle emitted. `drafter` has the target's head attached; `block_size` defaults to
    its own."""
    b = block_size or drafter.cfg.block_size
    num_drafts = b - 1 + drafter.cfg.verify_block_size - drafter.cfg.block_size  # DSpark: b
    first, end, _ = response_segments(batch.loss_mask, batch.cu_seqlens, max_new_tokens)
    ids, t = batch.input_ids, batch.input_ids.shape[0]
    device = ids.device
    steps = torch.arange(1, num_drafts + 1, device=device)
    rounds: list[torch.Tensor] = []
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast == "bf16"):
        positions = BlockLayout.build(
            batch.cu_seqlens, first[:0], t, b
        ).positions  # [T] within sequences
        kv = drafter.context_kv(batch.features, positions)
        anchor = first.clone()
        while True:
            live = torch.nonzero(anchor < end - 1)[:, 0]
            if live.numel() == 0:
                break
            a = anchor[live]
            layout = BlockLayout.build(
                batch.cu_seqlens, a, t, b
            )  # whole blocks, as the real loop drafts
            hidden = drafter.blocks(kv, ids, layout)  # [n, b, H]
            drafts = _greedy_drafts(drafter, hidden, ids[a], num_drafts)  # [n, drafts]
            pos = a[:, None] + steps  # [n, drafts] positions the drafts are for
            hit = (drafts == ids[pos.clamp(max=t - 1)]) & (pos < end[live][:, None])
            accepted = hit.long().cumprod(1).sum(1)
            emitted = torch.zeros_like(anchor)
            emitted[live] = cycle_length(accepted, a, end[live])
            anchor += emitted
            rounds.append(emitted)
    table = (
        torch.stack(rounds).T.tolist() if rounds else [[] for _ in range(first.shape[0])]
    )  # [R, rounds]
    return [[n for n in row if n > 0] for row in table]


def path_counts(lengths: list[list[int]]) -> torch.Tensor:
    """Per-response cycle lengths -> float64 [5] sums that add over batches and ranks: sum of the
    responses' mean cycle lengths, responses with cycles, tokens emitted by cycles, cycles,
    responses without a cycle (a one-token response: the prefill's token only)."""
    with_cycles = [row for row in lengths if row]
    return torch.tensor(
        [
            sum(sum(r) / len(r) for r in with_cycles),
            len(with_cycles),
            sum(map(sum, with_cycles)),
            sum(map(len, with_cycles)),
            len(lengths) - len(with_cycles),
        ],
        dtype=torch.float64,
    )


def summarize_path(counts: torch.Tensor) -> dict[str, Any]:
    """Sums of `path_counts` -> path_tau (the mean over responses of each one's mean over cycles,
    the DFlash authors' figure), path_tau_pooled (tokens per cycle over all cycles, the engines'
    figure), and how many responses and cycles they rest on."""
    c = counts.double().cpu().tolist()
    return {
        "path_tau": c[0] / c[1] if c[1] else math.nan,
        "path_tau_pooled": c[2] / c[3] if c[3] else math.nan,
        "path_sequences": int(c[1]),
        "path_cycles": int(c[3]),
        "path_sequences_without_cycles": int(c[4]),
    }
