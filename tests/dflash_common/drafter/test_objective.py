"""Anchors, labels, gamma weights and the tau estimate against the BRIEF's facts, by hand-made
cases."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_common.drafter.objective import (
    IGNORE_INDEX,
    AcceptanceCounts,
    block_labels,
    default_gamma,
    dpace_weights,
    sample_anchors,
)

# two sequences: [0, 10) with response 2..7, [10, 30) with response 11..29
CU = torch.tensor([0, 10, 30])
LOSS_MASK = torch.zeros(30, dtype=torch.bool)
LOSS_MASK[2:8] = True
LOSS_MASK[11:30] = True


def _anchors(seed, block_size=4, max_anchors=3):
    return sample_anchors(
        LOSS_MASK, CU, block_size, max_anchors, torch.Generator().manual_seed(seed)
    )


def test_anchors_are_response_positions_leaving_room_for_the_block():
    for seed in range(20):
        anchors = _anchors(seed, max_anchors=50)
        assert LOSS_MASK[anchors].all()
        seq0, seq1 = anchors[anchors < 10], anchors[anchors >= 10]
        assert (seq0 <= 10 - 4).all() and (seq1 <= 30 - 4).all()  # p <= S - B, local
        # with room for all: every eligible position, once, sorted
        assert seq0.tolist() == [2, 3, 4, 5, 6] and seq1.tolist() == list(range(11, 27))


def test_anchors_per_sequence_are_capped_distinct_and_seeded():
    a = _anchors(seed=3)
    assert (a < 10).sum() == 3 and (a >= 10).sum() == 3
    assert len(set(a.tolist())) == len(a) and torch.equal(a, a.sort().values)
    assert torch.equal(a, _anchors(seed=3))
    assert any(not torch.equal(a, _anchors(seed=s)) for s in range(4, 10))


def test_anchor_draws_cover_every_eligible_position_about_evenly():
    counts = torch.zeros(30)
    for seed in range(400):
        counts[_anchors(seed, max_anchors=2)] += 1
    seq1 = counts[11:27]  # 16 eligible positions, 2 drawn per seed: 50 expected each
    assert counts[27:].sum() == 0 and seq1.min() > 25 and seq1.max() < 80


def test_labels_are_the_same_position_and_the_anchor_is_not_a_prediction():
    input_ids = torch.arange(100, 130)
    anchors = torch.tensor([3, 12])
    labels, weights = block_labels(input_ids, LOSS_MASK, CU, anchors, block_size=4)
    assert labels[:, 0].eq(IGNORE_INDEX).all() and weights[:, 0].eq(0).all()
    assert labels[1].tolist() == [IGNORE_INDEX, 113, 114, 115]  # token at anchor + k, no shift
    # anchor 3: positions 4..6 are response tokens
    assert labels[0].tolist() == [IGNORE_INDEX, 104, 105, 106]


def test_gamma_weights_and_zero_weight_outside_the_mask_or_sequence():
    input_ids = torch.arange(30)
    anchors = torch.tensor([6, 26])  # 6: 8, 9 outside the mask; 26: 30+ past the sequence end
    labels, weights = block_labels(input_ids, LOSS_MASK, CU, anchors, block_size=8)
    gamma = 4.0  # B = 8
    assert weights[0, :3].tolist() == pytest.approx([0.0, 1.0, 0.0])  # 7 in mask; 8, 9 not
    assert weights[1, 1:4].tolist() == pytest.approx([math.exp(-k / gamma) for k in range(3)])
    assert weights[1, 4:].eq(0).all() and labels[1, 4:].eq(IGNORE_INDEX).all()
    assert weights[0, 3:].eq(0).all()  # past sequence 0 or outside its mask


def test_gamma_for_b16_is_7_and_weights_decay_from_k1():
    ids = torch.arange(40)
    mask = torch.ones(40, dtype=torch.bool)
    _, w = block_labels(ids, mask, torch.tensor([0, 40]), torch.tensor([3]), block_size=16)
    assert w[0].tolist() == pytest.approx([0.0] + [math.exp(-(k - 1) / 7) for k in range(1, 16)])


def test_default_gamma_published_points_and_interpolation():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert (
        default_gamma(12) == pytest.approx(5 + 2 / 3)
        and default_gamma(4) == 2.0
        and default_gamma(2) == 1.0
    )


def test_tau_counts_leading_correct_predictions_from_k1():
    correct = torch.tensor(
        [
            [False, True, True, False, True],  # 2 accepted (k=1, 2), the later hit does not count
            [True, False, True, True, True],  # 0 accepted; the anchor's correctness is irrelevant
            [False, True, True, True, True],  # 4 accepted, all valid
            [False, True, True, True, True],  # valid only up to k=2: 2 accepted
            [False, True, True, True, True],  # no valid prediction: not a block that counts
        ]
    )
    valid = torch.ones_like(correct)
    valid[:, 0] = False
    valid[3, 3:] = False
    valid[4] = False
    counts = AcceptanceCounts.from_blocks(correct, valid)
    assert counts.blocks == 4 and counts.accepted == 8
    assert counts.tau == pytest.approx(1 + 8 / 4)
    assert counts.per_position_accuracy[1:].tolist() == pytest.approx([3 / 4, 4 / 4, 2 / 3, 3 / 3])
    assert math.isnan(counts.per_position_accuracy[0])
    both = counts + counts
    assert both.tau == counts.tau and both.blocks == 8
    back = AcceptanceCounts.from_tensor(counts.to_tensor())
    assert back.tau == counts.tau and torch.equal(back.valid, counts.valid)


def test_rule_label_makes_the_last_response_tokens_anchors_and_rule_block_never():
    for seed in range(10):
        block = sample_anchors(LOSS_MASK, CU, 4, 50, torch.Generator().manual_seed(seed), "block")
        label = sample_anchors(LOSS_MASK, CU, 4, 50, torch.Generator().manual_seed(seed), "label")
        # 29 is last: no label to predict
        assert label.tolist() == [2, 3, 4, 5, 6] + list(range(11, 29))
        # 27, 28 never: no whole block
        assert block.tolist() == [2, 3, 4, 5, 6] + list(range(11, 27))
    labels, weights = block_labels(
        torch.arange(30), LOSS_MASK, CU, torch.tensor([28]), block_size=4
    )
    assert labels[0].tolist() == [
        IGNORE_INDEX,
        29,
        IGNORE_INDEX,
        IGNORE_INDEX,
    ]  # past the end: weight 0
    assert weights[0].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_a_sequence_of_exactly_one_block_and_an_end_of_turn_before_a_user_turn():
    cu, mask = torch.tensor([0, 4]), torch.ones(4, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    assert sample_anchors(mask, cu, 4, 9, g, "block").tolist() == [0]  # S = B: only p = 0
    assert sample_anchors(mask, cu, 4, 9, g, "label").tolist() == [0, 1, 2]
    # two turns: response 2..4 (4 = <|im_end|>), user 5..6, response 7..19
    cu, mask = torch.tensor([0, 20]), torch.zeros(20, dtype=torch.bool)
    mask[2:5] = mask[7:20] = True
    block = sample_anchors(mask, cu, 4, 99, g, "block").tolist()
    label = sample_anchors(mask, cu, 4, 99, g, "label").tolist()
    assert 4 in block and 4 not in label  # its k = 1 label is a user token: nothing to learn there
    assert label == [2, 3] + list(range(7, 19))


def test_an_unknown_anchor_rule_is_refused():
    with pytest.raises(ValueError, match="anchor rule"):
        sample_anchors(LOSS_MASK, CU, 4, 3, torch.Generator().manual_seed(0), "everywhere")


def _dpace_loop(ce: list[list[float]], valid: list[list[bool]], alpha: float) -> list[list[float]]:
    """The D-PACE formula written out position by position."""
    out = []
    for ce_row, m in zip(ce, valid):
        b = len(ce_row)
        q_soft = [alpha + (1 - alpha) * math.exp(-ce_row[k]) if m[k] else 1.0 for k in range(b)]
        c = [math.prod(q_soft[: k + 1]) for k in range(b)]
        out.append([float(m[k]) * sum(float(m[j]) * c[j] for j in range(k, b)) for k in range(b)])
    return out


@pytest.mark.parametrize("alpha", [0.5, 0.2, 1.0])
def test_dpace_weights_equal_the_formula_written_out(alpha):
    g = torch.Generator().manual_seed(1)
    ce = torch.rand(6, 5, generator=g) * 4
    valid = torch.rand(6, 5, generator=g) > 0.3
    valid[:, 0] = False  # the anchor
    valid[5] = False  # a block with nothing to predict
    got = dpace_weights(ce, valid, alpha)
    want = torch.tensor(_dpace_loop(ce.tolist(), valid.tolist(), alpha))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[~valid].eq(0).all() and got.dtype == torch.float32
    # every factor 1: w_k = valid positions from k on (a linear, not exponential, decay)
    if alpha == 1.0:
        torch.testing.assert_close(got[valid], valid.flip(1).cumsum(1).flip(1).float()[valid])


def test_dpace_weights_carry_no_gradient():
    ce = torch.rand(2, 4, requires_grad=True)
    valid = torch.tensor([[False, True, True, True]] * 2)
    assert not dpace_weights(ce, valid, 0.5).requires_grad
