"""Token-budget batches, and the promise that padding never leaks into a sequence's states."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from precompute.batching import pad_right, padding_fraction, plan_batches, unpad
from precompute.target import load_target


@given(lengths=st.lists(st.integers(1, 300), max_size=60), budget=st.integers(1, 1000))
def test_batches_cover_everything_once_within_budget_longest_first(lengths, budget):
    batches = plan_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert len(b) == 1 or len(b) * longest <= budget
        assert lengths[b[0]] == longest
    firsts = [lengths[b[0]] for b in batches]
    assert firsts == sorted(firsts, reverse=True)
    assert plan_batches(lengths, budget) == batches


def test_batches_example_and_padding_fraction():
    lengths = [5, 9, 3, 9, 1]
    assert plan_batches(lengths, 20) == [[1, 3], [0, 2, 4]]
    assert padding_fraction(lengths, [[1, 3], [0, 2, 4]]) == pytest.approx(1 - 27 / 33)
    assert plan_batches([50, 2], 10) == [[0], [1]]  # over budget: alone


def test_pad_right_and_unpad():
    seqs = [np.array([1, 2, 3], np.int32), np.array([4], np.int32)]
    batch = pad_right(seqs, pad_id=0)
    assert batch.dtype == torch.int64 and batch.tolist() == [[1, 2, 3], [4, 0, 0]]
    states = torch.arange(2 * 3 * 2).reshape(2, 3, 2)
    assert [s.shape[0] for s in unpad(states, [3, 1])] == [3, 1]


@pytest.mark.parametrize("which", ["tiny", "hybrid_vlm"])
def test_states_do_not_depend_on_batch_companions(which, tiny_target, tiny_vlm):
    """Same sequence alone and right-padded among longer/shorter ones, float32; the hybrid target's
    linear-attention layers scan left to right too (its CPU fallback is slow: one case only)."""
    path = tiny_target if which == "tiny" else tiny_vlm[0]
    target = load_target(path, [0, 2, 4], dtype="fp32")
    gen = torch.Generator().manual_seed(3)
    seq, shorter, longer = (torch.randint(0, 256, (n,), generator=gen).numpy() for n in (40, 7, 70))
    alone = target.forward(pad_right([seq], pad_id=0))
    cases = (
        [([longer], 0), ([shorter], 257), ([longer, shorter], 0)]
        if which == "tiny"
        else [([longer, shorter], 257)]
    )
    for companions, pad_id in cases:
        batch = [*companions, seq]
        states = target.forward(pad_right(batch, pad_id))
        for k in range(3):
            got = unpad(states[k], [len(s) for s in batch])[-1]
            torch.testing.assert_close(got, alone[k][0], rtol=1e-5, atol=1e-5)


def test_the_leak_check_would_see_left_padding(tiny_target):
    """Control: left padding without a mask does change the states, so the check above can fail."""
    target = load_target(tiny_target, [2], dtype="fp32")
    seq = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(4))
    (alone,) = target.forward(seq[None])
    (left,) = target.forward(torch.cat([torch.zeros(10, dtype=torch.long), seq])[None])
    assert not torch.allclose(left[0, 10:], alone[0], atol=1e-3)
