"""The training step's objective: one packed batch through the drafter, its block labels and
weights, and the fused LM-head loss; the trainer minimises it (train/loop.py) and validation reports
it (train/validate.py). A DFlash2 drafter adds its selector loss (loss/selector.py) over the top-k
the fused loss hands over, and its correctness is the served walk's.

    loss_sum, normaliser, counts = batch_objective(drafter, model, batch, block_size=B, gamma=7.0,
                                                   autocast="bf16")

A DSpark drafter (drafter.arch = dspark) has its own objective, `dspark_objective`, which
batch_objective hands it to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_common.drafter.loss import (
    fused_lm_head_loss,
    greedy_prompt_labels,
    soft_kind,
    soft_lm_head_loss,
    teacher_rows,
)
from dflash_common.drafter.loss.markov import Soft, markov_lm_head_loss
from dflash_common.drafter.loss.selector import block_selector_loss, top_k_logits
from dflash_common.drafter.model import DFlashDrafter
from dflash_common.drafter.objective import (
    IGNORE_INDEX,
    accepted_drafts,
    block_labels,
    dpace_weights,
    serving_path,
)
from train.config import ObjectiveSection, SoftTargetsSection
from train.transfer import DeviceBatch


def block_counts(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """bool [A, B] -> float64 [2B + 2] on the same device, laid out as `AcceptanceCounts.to_tensor`
    (correct per position, valid per position, accepted drafts, blocks). Stays on the device, so a
    training step never waits for the GPU just to count."""
    accepted = accepted_drafts(correct, valid)
    has_any = valid[:, 1:].any(1)
    return torch.cat(
        [
            (correct & valid).sum(0).double(),
            valid.sum(0).double(),
            (accepted * has_any).sum().double()[None],
            has_any.sum().double()[None],
        ]
    )


def unweighted_ce(ce_rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """float64 [2] on the device: (sum of the valid rows' CE, their number). Their quotient is the
    CE of every labelled block position alike, whatever the objective weighs: what a training
    interval and validation both report as `ce`, so the two compare."""
    ce = torch.where(valid, ce_rows.detach().float(), 0.0)
    return torch.stack([ce.sum(), valid.sum()]).double()


def batch_objective(
    drafter: DFlashDrafter,
    model: torch.nn.Module,
    batch: DeviceBatch,
    *,
    block_size: int,
    gamma: float | None,
    autocast: str,
    weights: str = "gamma",
    dpace_alpha: float = 0.5,
    normalise: str = "weight",
    targets: SoftTargetsSection | None = None,
    path_weight: float = 0.0,
    loss_method: str = "exact",
    objective: ObjectiveSection | None = None,
    extras: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed batch through `model` (the drafter, or its DDP wrapper) and the fused loss.

    `weights` 'gamma' or 'dpace', `normalise` 'weight' or 'anchors' and `path_weight` as in
    train/config.py's [objective]; D-PACE weights and the serving path come from the same forward's
    per-row CE and correctness (no second pass). `targets` (train config's [targets]) switches on
    soft targets and prompt-anchor labels (the config refuses them with path_weight); with them,
    D-PACE's confidence is the drafter's probability of the label (the stored token, or the target's
    greedy token on a prompt position) while the rows it weighs are the soft kind's loss.
    `loss_method`: the hard loss's method (precision.loss_method; fused_lm_head_loss runs
    'odds_epilogue' as 'odds' on a CPU). `objective` (the train config's [objective]; its defaults
    when None) holds the options of the drafters built on DFlash's backbone (drafter/arch.py); the
    arguments above are read from the caller, which may override them (validation does).
    A DFlash2 drafter adds selector_weight x its selector CE (`selector_candidates`,
    `selector_stop_gradient`: loss/selector.py) under the same row weights; its counts are the
    served walk's; D-PACE's confidence is the served proposal's probability of the label
    (`dpace_confidence` = 'served': the selector's, 0 when the label is not a candidate) or the
    unary softmax's ('unary'). `extras`, when given, receives 'ce' (`unweighted_ce`) and DFlash2's
    diagnostics ('unary': counts of the argmax, laid out as the counts; 'selector': [weighted
    selector CE, labels among the candidates, prediction rows], float64). A DSpark drafter's
    objective is `dspark_objective`.
    Returns (weighted loss sum: float32 scalar with grad, its normaliser: the weight sum or the
    number of blocks with a valid label, those on the serving path counted 1 + path_weight times,
    float32 scalar, counts [2B+2]).
    """
    o = objective if objective is not None else ObjectiveSection()
    if drafter.cfg.arch == "dspark":
        return dspark_objective(
            drafter,
            model,
            batch,
            gamma=gamma,
            autocast=autocast,
            weights=weights,
            dpace_alpha=dpace_alpha,
            normalise=normalise,
            targets=targets,
            objective=o,
            extras=extras,
        )
    device = batch.features.device
    top_k = drafter.cfg.selector_top_k if drafter.cfg.arch == "dflash2" else 0
    prompt = targets is not None and targets.prompt_anchors
    mask = (
        torch.ones_like(batch.loss_mask) if prompt else batch.loss_mask
    )  # prompt labels count too
    labels, w = block_labels(
        batch.input_ids, mask, batch.cu_seqlens, batch.anchors, block_size, gamma
    )  # [A, B] each
    if prompt:
        labels = greedy_prompt_labels(labels, batch.loss_mask, batch.anchors)
    valid = labels != IGNORE_INDEX
    enabled = autocast == "bf16"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled):
        hidden = model(
            batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors
        )  # [A, B, H]
        row_w = valid.float() if weights == "dpace" else w  # D-PACE: unit weights, reweighted below
        if targets is not None and targets.needs_final_state:
            out = soft_lm_head_loss(
                hidden.flatten(0, 1),
                drafter.lm_head_weight,
                labels.flatten(),
                row_w.flatten(),
                batch.final,
                teacher_rows(batch.anchors, block_size).flatten(),
                soft_kind(targets.soft),
                targets.temperature,
            )
        else:
            out = fused_lm_head_loss(
                hidden.flatten(0, 1),
                drafter.lm_head_weight,
                labels.flatten(),
                row_w.flatten(),
                method=loss_method,
                top_k=top_k,
            )
        sel = None
        if top_k:  # DFlash2: the selector over the loss's top-k (the soft loss has none: a pass)
            tops = (
                (out.top_ids, out.top_values)
                if out.top_ids is not None
                else top_k_logits(hidden.flatten(0, 1), drafter.lm_head_weight, top_k)
            )
            sel = block_selector_loss(
                drafter,
                hidden,
                batch.input_ids,
                batch.anchors,
                labels,
                *tops,
                o.selector_candidates,
                o.selector_stop_gradient,
            )
    if extras is not None:  # CE to the label, every valid row alike: train and held-out compare
        ce_rows = out.ce if out.ce is not None else out.rows.detach() / row_w.flatten()
        extras["ce"] = unweighted_ce(ce_rows, valid.flatten())
    unary_correct = out.correct.view_as(labels)  # [A*B] -> [A, B]
    correct = unary_correct if sel is None else sel.correct & valid  # what is served
    row_scale = (
        None  # what multiplies out.rows (per-row CE, gamma-weighted under 'gamma'); None: out.loss
    )
    if (
        weights == "dpace"
    ):  # from the drafter's CE to the label (the soft loss's rows are another kind)
        ce = (out.rows if out.ce is None else out.ce).detach().view_as(labels)
        if sel is not None and o.dpace_confidence == "served":  # the selector's: 0 off the top-k
            ce = torch.where(sel.in_top_k, sel.ce.detach(), torch.inf)
        w = dpace_weights(ce, valid, dpace_alpha)
        row_scale = w
    block_w = None
    if path_weight:  # 0: the objective without serving-path weights, bit for bit
        on_path = serving_path(
            batch.anchors, accepted_drafts(correct, valid), batch.loss_mask, batch.cu_seqlens
        )
        block_w = 1.0 + path_weight * on_path.float()  # [A], detached: from argmax correctness
        w = w * block_w[:, None]
        row_scale = w if weights == "dpace" else block_w[:, None].expand_as(w)
    loss = out.loss if row_scale is None else (row_scale.flatten() * out.rows).sum()
    if sel is not None:
        selector_sum = (w * sel.ce).sum()  # the same row weights (path weights included)
        loss = loss + o.selector_weight * selector_sum
        if extras is not None:
            extras["unary"] = block_counts(unary_correct, valid)
            extras["selector"] = torch.stack(
                [selector_sum.detach(), (sel.in_top_k & valid).sum(), valid[:, 1:].sum()]
            ).double()
    has_label = valid[:, 1:].any(1).float()  # [A]
    blocks = (
        has_label if block_w is None else has_label * block_w
    )  # a block on the path counts 1 + path_weight
    norm = blocks.sum() if normalise == "anchors" else w.sum()
    return loss, norm, block_counts(correct, valid)


# ---------------------------------------------------------------- DSpark


def dspark_objective(
    drafter: DFlashDrafter,
    model: torch.nn.Module,
    batch: DeviceBatch,
    *,
    gamma: float | None,
    autocast: str,
    weights: str = "gamma",
    dpace_alpha: float = 0.5,
    normalise: str = "weight",
    targets: SoftTargetsSection | None = None,
    objective: ObjectiveSection | None = None,
    extras: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DSpark drafter's objective on a packed batch, as `batch_objective` returns it (counts laid
    out over the verified block [anchor, B drafts]: 2(B+1)+2).

    Block row j predicts the token at a+j+1 (j = 0..B-1), with the Markov bias of the true token at
    a+j (teacher forcing): labels and weights are those of a DFlash block of B+1 rows less its row
    0, so the gamma decay is exp(-j/gamma) from the anchor row on (gamma by B+1: 4 for B = 7, as
    DeepSpec's recipe), and D-PACE's weights follow from the rows' own CE as for DFlash. The loss:
      CE of the Markov-corrected logits (or the soft kind of `targets.soft`, matching the target's
      distribution from its final state at a+j), weighted, fused with the bias (loss/markov.py);
      + confidence_weight * the same weights * BCE(confidence logit, label), the label being whether
      the row's greedy draft is its token ('match') or 1 - TV ('tv'), detached; the confidence head
      reads the block's hidden states and Markov embeddings, detached too under confidence_detach.
    `objective` holds confidence_weight, confidence_label, confidence_detach (its defaults when
    None: 1.0, 'match', detached). `extras`, when given, receives 'ce': the Markov-corrected
    logits' CE (`unweighted_ce`)."""
    b = drafter.cfg.block_size
    labels, w = block_labels(
        batch.input_ids, batch.loss_mask, batch.cu_seqlens, batch.anchors, b + 1, gamma
    )
    labels, w = labels[:, 1:], w[:, 1:]  # [A, B]: row j predicts the token at a + j + 1
    valid = labels != IGNORE_INDEX
    # [A, B]: the true token at a + j
    prev = drafter.previous_tokens(batch.input_ids, batch.anchors, b)
    if weights == "dpace":

        def weigh(ce, ok, first):
            return dpace_weights(ce, ok, dpace_alpha)
    else:

        def weigh(ce, ok, first):
            return w[first : first + ce.shape[0]]

    soft = None
    if targets is not None and targets.soft != "none":
        rows = batch.anchors.long()[:, None] + torch.arange(b, device=labels.device)  # [A, B]
        soft = Soft(
            batch.final,
            rows.clamp(max=batch.final.shape[0] - 1).flatten(),
            soft_kind(targets.soft),
            targets.temperature,
        )  # the target's state at a + j predicts the token at a + j + 1
    with torch.autocast(
        batch.features.device.type, dtype=torch.bfloat16, enabled=autocast == "bf16"
    ):
        # [A, B, H]
        hidden = model(batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors)
        embed = drafter.markov_embed(prev)  # [A, B, r]
        out = markov_lm_head_loss(
            hidden.flatten(0, 1),
            drafter.lm_head_weight,
            embed.flatten(0, 1),
            drafter.markov_head.markov_w2.weight,
            labels.flatten(),
            b,
            weigh,
            soft,
        )
    w = out.weights.view_as(labels)
    correct = out.correct.view_as(labels)
    if extras is not None:
        extras["ce"] = unweighted_ce(out.ce, valid.flatten())
    o = objective if objective is not None else ObjectiveSection()
    loss = out.loss + _confidence_loss(drafter, hidden, embed, out, w, o)
    norm = valid.any(1).float().sum() if normalise == "anchors" else w.sum()
    pad = valid.new_zeros(valid.shape[0], 1)  # the verified block's row 0: the anchor
    return loss, norm, block_counts(torch.cat([pad, correct], 1), torch.cat([pad, valid], 1))


def _confidence_loss(drafter, hidden, embed, out, w, o: ObjectiveSection) -> torch.Tensor:
    """confidence_weight * sum of w * BCE(confidence logit, label) over the block rows (0 without a
    head)."""
    if drafter.confidence_head is None:
        return hidden.new_zeros((), dtype=torch.float32)
    weight, label, detach = o.confidence_weight, o.confidence_label, o.confidence_detach
    if detach:
        hidden, embed = hidden.detach(), embed.detach()
    logit = drafter.confidence_logits(hidden, embed)  # [A, B] float32
    if label == "tv":
        if out.tv is None:
            raise ValueError(
                "confidence_label 'tv' needs a soft kind with an L1 term (targets.soft = tv, "
                "dspark)"
            )
        target = (1.0 - out.tv.view_as(w)).clamp(0.0, 1.0)
    else:
        target = out.correct.view_as(w).float()  # greedy verification accepts exactly these
    return weight * (w * F.binary_cross_entropy_with_logits(logit, target, reduction="none")).sum()
