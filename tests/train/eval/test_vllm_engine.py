"""train/eval/vllm_engine.py without vLLM: the counters vLLM must report for cycles our engine made.

vLLM runs a cycle only while fewer than max_new_tokens tokens are out, and none after a stop token
from the prefill; the authors' loop (train/eval/spec_decode.py) runs one more when exactly that many
are out, and one after a prefill stop. The serve check compares these counters with vLLM's per
prompt.
"""

from __future__ import annotations

from train.eval.vllm_engine import expected_counters

BLOCK, EOS = 4, 7


def test_cycles_before_the_limit_count_uncut():
    # 1 (prefill) + 4 + 2 = 7 < 8: the third cycle runs and counts all 3 accepted drafts, though
    # only one of its tokens is kept
    got = expected_counters(
        [4, 2, 4], first_token=1, block_size=BLOCK, max_new_tokens=8, stop_ids={EOS}
    )
    assert got == {"drafts": 3, "accepted": 3 + 1 + 3, "per_pos": [3, 2, 2]}


def test_a_cycle_at_the_limit_is_not_vllms():
    # 1 + 4 + 3 = 8 tokens out: vLLM stops, the authors' loop drafts once more
    got = expected_counters(
        [4, 3, 2], first_token=1, block_size=BLOCK, max_new_tokens=8, stop_ids={EOS}
    )
    assert got == {"drafts": 2, "accepted": 3 + 2, "per_pos": [2, 2, 1]}


def test_a_stop_token_from_the_prefill_gets_no_cycle():
    got = expected_counters(
        [3], first_token=EOS, block_size=BLOCK, max_new_tokens=8, stop_ids={EOS}
    )
    assert got == {"drafts": 0, "accepted": 0, "per_pos": [0, 0, 0]}


def test_no_drafts_accepted():
    got = expected_counters([1, 1], first_token=1, block_size=BLOCK, max_new_tokens=8, stop_ids=())
    assert got == {"drafts": 2, "accepted": 0, "per_pos": [0, 0, 0]}
