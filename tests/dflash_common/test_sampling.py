"""dflash_common.sampling: one top-k/top-p rule, transformers' own, used by generate and eval."""

from __future__ import annotations

import pytest
import torch

from dflash_common.sampling import Sampling, sampling_probs, top_p_filter


def test_temperature_top_k_top_p():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    torch.testing.assert_close(
        sampling_probs(logits, Sampling(1.0)), torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    )
    torch.testing.assert_close(
        sampling_probs(logits, Sampling(1.0, top_k=2)), torch.tensor([[4 / 7, 3 / 7, 0, 0]])
    )
    torch.testing.assert_close(
        sampling_probs(logits, Sampling(1.0, top_p=0.65)), torch.tensor([[4 / 7, 3 / 7, 0, 0]])
    )
    torch.testing.assert_close(
        sampling_probs(logits, Sampling(1.0, top_p=0.3)), torch.tensor([[1.0, 0, 0, 0]])
    )
    sharp = sampling_probs(logits, Sampling(0.5))
    torch.testing.assert_close(sharp, torch.tensor([[16, 9, 4, 1]]) / 30.0)
    assert Sampling().greedy and not Sampling(0.5).greedy


def test_top_p_at_the_boundary_keeps_the_crossing_token_and_drops_the_next():
    # dyadic probabilities: every partial sum is exact in float32, so the boundary is hit exactly
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    # the first two hold exactly 0.75: the third would start after the mass reached top_p
    torch.testing.assert_close(top_p_filter(probs, 0.75), torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    # just below: the second token crosses top_p and is kept, the third is not
    torch.testing.assert_close(top_p_filter(probs, 0.7), torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    # just above: the third token crosses top_p and is kept
    torch.testing.assert_close(top_p_filter(probs, 0.76), torch.tensor([[4 / 7, 2 / 7, 1 / 7, 0]]))
    torch.testing.assert_close(top_p_filter(probs, 0.5), torch.tensor([[1.0, 0, 0, 0]]))
    torch.testing.assert_close(
        top_p_filter(probs, 0.01), torch.tensor([[1.0, 0, 0, 0]])
    )  # never empty
    assert top_p_filter(probs, 1.0) is probs


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 0.9), (0.7, 50, 0.8), (1.3, 5, 1.0), (1.0, 0, 0.5), (0.8, 20, 0.95)],
)
def test_the_rule_is_transformers_own(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList(
        [TemperatureLogitsWarper(temperature)]
        + ([TopKLogitsWarper(top_k)] if top_k else [])
        + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
    )
    theirs = warpers(torch.zeros(16, 1, dtype=torch.long), logits.clone()).softmax(-1)
    ours = sampling_probs(logits, Sampling(temperature, top_p, top_k))
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens kept
    torch.testing.assert_close(ours, theirs)


def test_generate_and_eval_draw_the_same_tokens_from_the_same_distribution():
    from precompute.generate.decode import sample_next
    from train.eval.spec_decode import choose

    # the third token starts exactly at top_p = 0.75, where the two stages' old rules disagreed
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    s = Sampling(1.0, top_p=0.75, max_new_tokens=8, seed=0)
    seeds = range(400)
    generated = [int(sample_next(logits, s, [torch.Generator().manual_seed(k)])[0]) for k in seeds]
    evaluated = [choose(logits[0], s, torch.Generator().manual_seed(k)) for k in seeds]
    assert generated == evaluated
    assert set(generated) == {0, 1}  # never the token past the boundary
    assert 0.55 < generated.count(0) / len(generated) < 0.78  # p = 2/3
