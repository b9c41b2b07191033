"""A record dflash-generate cut by max_new_tokens (finish_reason "length") must not teach a false
end of turn: dflash-precompute puts no loss on the end-of-turn token the template appends to its
last answer."""

from __future__ import annotations

import numpy as np
import pytest

from precompute.config import DataSection
from precompute.inputs import RawRecord
from precompute.tokenizing import UnitTokenizer

from precompute_helpers import chat


def _record(i, finish_reason):
    import json

    obj = {**chat(i), "finish_reason": finish_reason}
    return RawRecord(i, f"gen.jsonl:{i + 1}", json.dumps(obj).encode())


@pytest.mark.parametrize(
    "target", ["tiny_target", "tiny_target_2layer"]
)  # marked template, and not
def test_the_end_of_turn_of_a_cut_answer_weighs_nothing(target, request):
    path = request.getfixturevalue(target)
    tokenizer = UnitTokenizer.from_target(str(path), DataSection(block_size=4, max_length=512))
    stop = tokenizer(0, [_record(0, "stop")])
    cut = tokenizer(0, [_record(0, "length")])
    assert np.array_equal(stop.input_ids, cut.input_ids)
    end_of_turn = tokenizer.chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    last = int(np.flatnonzero(stop.loss_mask)[-1])
    assert stop.input_ids[last] == end_of_turn  # a finished answer learns its end of turn
    expected = stop.loss_mask.copy()
    expected[last] = 0
    assert np.array_equal(cut.loss_mask, expected)  # a cut one: the same mask but there
