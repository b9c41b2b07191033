"""What the batched-decoding tests of the drafter kinds share."""

from __future__ import annotations

from typing import Sequence


def batched_decodes_as_one_at_a_time(
    model, proposer, prompts: Sequence[Sequence[int]], block_size: int, max_new_tokens: int = 40
) -> list:
    """Decode `prompts` through the batched loop (train/eval/batched.py) and one at a time
    (spec_decode.py), asserting that every prompt gets the same tokens and cycles (accepted and
    emitted lengths, cycle for cycle) both ways and that its tokens are the target's own (float32).
    -> the one-at-a-time results, in prompt order."""
    from train.eval.batched import BatchedTarget, as_batched, speculative_generate_batch
    from train.eval.spec_decode import TargetRunner, speculative_generate, target_generate

    target = TargetRunner(model, proposer.layer_ids)
    together = speculative_generate_batch(
        BatchedTarget(model, proposer.layer_ids),
        as_batched(proposer),
        prompts,
        block_size=block_size,
        max_new_tokens=max_new_tokens,
    )
    single = []
    for ids, b in zip(prompts, together, strict=True):
        a = speculative_generate(
            target, proposer, ids, block_size=block_size, max_new_tokens=max_new_tokens
        )
        assert b.acceptance_lengths == a.acceptance_lengths
        assert b.emitted == a.emitted
        alone = target_generate(target, ids, max_new_tokens=max_new_tokens).tokens
        assert b.tokens == a.tokens == alone
        single.append(a)
    return single
