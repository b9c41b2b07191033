"""DFlash2's selector loss: teacher-forced K-way cross-entropy over each prediction's top-k lattice.

For a prediction row (block position k >= 1) with hidden state h, label y, the label's predecessor
p (the token at position k - 1: the block's first token at k = 1), candidates c_1..c_K = the top-k
of the drafter's logits (fused_lm_head_loss(top_k=K) hands them over, no second logits matmul) and
their logits u_j = h . W[c_j]:

    s_j = u_j + (P[p] * proj(h)) . S[c_j]         the edge score the served walk reads (dflash2.py)
    CE = -log softmax(s)[j*], c_{j*} = y

Teacher forcing is exact for what serving accepts: the walk's previous token is the gold one
whenever every earlier draft of the block was accepted, and only then does position k's choice
count. So `correct` (the walk would pick y here: y among the candidates and s's argmax, lowest index
on ties) gives, through accepted_drafts, the served acceptance of the block, not an estimate of it.

Candidate sets when y is not among the top-k (a recall miss the selector cannot fix):
- 'gold' (speculators' trainer): y replaces the K-th (weakest) candidate in the loss only, with its
  own logit, so the selector still learns y against the others and the gradient raises y's logit;
- 'strict' (SpecForge's): the row weighs nothing in this loss (the caller multiplies by `in_top_k`);
  the base CE alone must raise y into the top-k.
The unary logits carry gradient into the drafter unless `stop_gradient` (then the selector term
trains only the selector: codebooks and projection).

Memory: the bilinear term gathers S[c] ([M, K, r]) a chunk of rows at a time and keeps only the
queries and ids for the backward; the unary logits' gradient is an embedding-bag over W's rows
([M, H]), never a gathered [M, K, H].
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

Candidates = Literal["gold", "strict"]
_ROWS_PER_CHUNK = (
    8192  # rows of the [rows, K, r] successor gather at once (8192 x 16 x 256 x 4 B = 128 MiB)
)


class SelectorOutput(NamedTuple):
    ce: torch.Tensor  # [M] float32: the row's K-way CE (grad), 0 where strict leaves the row out
    correct: (
        torch.Tensor
    )  # [M] bool: the served walk picks the label here (label among the top-k, argmax)
    in_top_k: torch.Tensor  # [M] bool: the label is among the top-k candidates


def selector_loss(
    selector,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    previous: torch.Tensor,
    top_ids: torch.Tensor,
    top_values: torch.Tensor,
    candidates: Candidates = "gold",
    stop_gradient: bool = False,
) -> SelectorOutput:
    """Per prediction row: hidden [M, H] (final, normed), labels and previous tokens [M], the top-k
    ids [M, K] by descending logit and their logits [M, K] (float32) -> SelectorOutput."""
    if candidates not in ("gold", "strict"):
        raise ValueError(f"selector candidates {candidates!r} unknown; use 'gold' or 'strict'")
    match = top_ids == labels[:, None]  # [M, K]
    in_top_k = match.any(-1)
    target = match.int().argmax(
        -1
    )  # the label's column (0 where absent; such rows are fixed below)
    ids, values = top_ids, top_values
    if candidates == "gold":  # the label takes the last column of rows that miss it
        missing = ~in_top_k
        last = torch.full_like(labels, top_ids.shape[1] - 1)
        ids = torch.where(
            missing[:, None] & (torch.arange(ids.shape[1], device=ids.device) == last[:, None]),
            labels[:, None],
            top_ids,
        )
        label_logit = _label_logits(hidden.detach(), lm_head_weight, labels)  # [M]
        values = torch.where(
            missing[:, None] & (ids == labels[:, None]), label_logit[:, None], top_values
        )
        target = torch.where(missing, last, target)
    h = hidden.detach() if stop_gradient else hidden
    unary = values if stop_gradient else GatheredLogits.apply(h, lm_head_weight, ids, values)
    queries = selector.queries(h, previous).float()  # [M, r]
    scores = unary + candidate_dot(queries, selector.successor_codebook, ids)  # [M, K]
    ce = F.cross_entropy(scores, target, reduction="none")
    if candidates == "strict":
        ce = torch.where(in_top_k, ce, 0.0)
    correct = in_top_k & (scores.detach().argmax(-1) == target)  # injected rows are never correct
    return SelectorOutput(ce, correct, in_top_k)


def _label_logits(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """h . W[y] per row in float32, in chunks ([rows, H] gathered at once)."""
    out = [
        (hidden[i : i + _ROWS_PER_CHUNK].to(weight.dtype) * weight[labels[i : i + _ROWS_PER_CHUNK]])
        .float()
        .sum(-1)
        for i in range(0, hidden.shape[0], _ROWS_PER_CHUNK)
    ]
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


class GatheredLogits(torch.autograd.Function):
    """u[m, j] = hidden[m] . W[ids[m, j]] whose values are already known (the top-k taken from the
    fused loss's logits): the forward returns them, the backward gives d hidden[m] = sum_j du[m, j]
    W[ids[m, j]] as one embedding-bag (W is frozen: no gradient for it)."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, values):
        ctx.save_for_backward(weight, ids)
        ctx.hidden_dtype = hidden.dtype
        return values.float().clone()

    @staticmethod
    def backward(ctx, grad):
        weight, ids = ctx.saved_tensors
        d_hidden = F.embedding_bag(
            ids, weight, per_sample_weights=grad.to(weight.dtype), mode="sum"
        )
        return d_hidden.to(ctx.hidden_dtype), None, None, None


def candidate_dot(queries: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[M, K] = sum_r queries[m, r] * table[ids[m, k], r], with gradients to queries and table."""
    return _CandidateDot.apply(queries, table, ids)


class _CandidateDot(torch.autograd.Function):
    """The bilinear term a chunk of rows at a time, keeping only queries and ids for the backward
    (autograd through a plain gather would keep the whole [M, K, r] gather)."""

    @staticmethod
    def forward(ctx, queries, table, ids):
        ctx.save_for_backward(queries, table, ids)
        out = [
            torch.einsum(
                "mr,mkr->mk",
                queries[i : i + _ROWS_PER_CHUNK],
                table[ids[i : i + _ROWS_PER_CHUNK]].to(queries.dtype),
            )
            for i in range(0, queries.shape[0], _ROWS_PER_CHUNK)
        ]
        return torch.cat(out) if out else queries.new_zeros(ids.shape)

    @staticmethod
    def backward(ctx, grad):
        queries, table, ids = ctx.saved_tensors
        d_queries = F.embedding_bag(ids, table, per_sample_weights=grad.to(table.dtype), mode="sum")
        d_table = torch.zeros_like(table)
        for i in range(0, queries.shape[0], _ROWS_PER_CHUNK):
            rows = slice(i, i + _ROWS_PER_CHUNK)
            outer = grad[rows, :, None] * queries[rows, None, :]  # [m, K, r]
            d_table.index_add_(0, ids[rows].flatten(), outer.flatten(0, 1).to(table.dtype))
        return d_queries.to(queries.dtype), d_table, None


def block_selector_loss(
    drafter,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    labels: torch.Tensor,
    top_ids: torch.Tensor,
    top_values: torch.Tensor,
    candidates: Candidates = "gold",
    stop_gradient: bool = False,
) -> SelectorOutput:
    """The selector loss of a packed batch's blocks: hidden [A, B, H], input_ids [T] (packed),
    anchors [A], labels [A, B] (IGNORE_INDEX where no prediction), the fused loss's top-k [A*B, K]
    -> the fields of SelectorOutput as [A, B] (0 / False where no prediction). Each row's
    predecessor is the stored token before its label: the anchor's own token at block position 1."""
    a, b = labels.shape
    k = torch.arange(b, device=anchors.device)
    pos = (anchors.long()[:, None] + k - 1).clamp(
        0, input_ids.shape[0] - 1
    )  # [A, B]: the position before
    rows = (labels >= 0).flatten().nonzero().squeeze(1)  # [M] prediction rows (one host sync)
    out = selector_loss(
        drafter.candidate_selector,
        hidden.flatten(0, 1)[rows],
        drafter.lm_head_weight,
        labels.flatten()[rows],
        input_ids.long()[pos].flatten()[rows],
        top_ids[rows],
        top_values[rows],
        candidates,
        stop_gradient,
    )
    ce = hidden.new_zeros(a * b, dtype=torch.float32).index_put((rows,), out.ce)  # keeps the graph
    flags = [
        torch.zeros(a * b, dtype=torch.bool, device=hidden.device).index_put_((rows,), f)
        for f in (out.correct, out.in_top_k)
    ]
    return SelectorOutput(ce.view(a, b), *(f.view(a, b) for f in flags))


@torch.no_grad()
def top_k_logits(
    hidden: torch.Tensor, weight: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, k], values [N, k] float32) of hidden [N, H] @ W^T, in chunks of rows: for losses
    that hand over no top-k (the soft loss)."""
    ids, values = [], []
    step = max(1, (1 << 26) // weight.shape[0])  # logits held at once: 64 Mi values
    for i in range(0, hidden.shape[0], step):
        v, j = torch.topk(hidden[i : i + step].to(weight.dtype) @ weight.T, k, dim=-1)
        ids.append(j)
        values.append(v.float())
    if not ids:
        return hidden.new_zeros((0, k), dtype=torch.long), hidden.new_zeros(
            (0, k), dtype=torch.float32
        )
    return torch.cat(ids), torch.cat(values)
