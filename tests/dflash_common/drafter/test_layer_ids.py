import pytest

from dflash_common.drafter.layer_ids import (
    check_layer_ids,
    default_layer_ids,
    hf_hidden_states_index,
)


def test_dflash_rule_matches_released_qwen3_8b_drafter():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]  # BRIEF: Qwen3-8B, N=36


def test_rule_for_the_tiny_target_and_single_layer():
    assert default_layer_ids(8) == [1, 2, 3, 4, 5]
    assert default_layer_ids(8, k=1) == [4]


def test_too_shallow_target_is_refused():
    with pytest.raises(ValueError, match="list the layer ids explicitly"):
        default_layer_ids(4)


def test_layer_id_is_decoder_output_not_embedding():
    assert hf_hidden_states_index(0) == 1


def test_check_layer_ids():
    check_layer_ids([1, 2], 8)
    with pytest.raises(ValueError, match="outside"):
        check_layer_ids([8], 8)
    with pytest.raises(ValueError, match="repeat"):
        check_layer_ids([1, 1], 8)
