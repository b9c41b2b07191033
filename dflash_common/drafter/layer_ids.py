"""Which target layers a DFlash drafter reads.

An id i means the *output of decoder layer i* (0-based), which is HF `hidden_states[i + 1]`
(`hidden_states[0]` is the embedding output). Off-by-one here is the field's most common silent bug.
"""

from __future__ import annotations

# K=5 target layers for Qwen3/Llama drafters (DFlash paper and its released checkpoints).
DEFAULT_NUM_TARGET_LAYERS = 5


def default_layer_ids(num_target_layers: int, k: int = DEFAULT_NUM_TARGET_LAYERS) -> list[int]:
    """K ids spread evenly from layer 1 to layer N-3 (the DFlash rule):
    N=36 -> [1, 9, 17, 25, 33]."""
    if k < 1:
        raise ValueError(f"the number of target layers to capture must be >= 1, got {k}")
    if k == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end - start + 1 < k:
        raise ValueError(
            f"a {num_target_layers}-layer target has too few layers between 1 and N-3 for {k} "
            f"distinct ids; list the layer ids explicitly"
        )
    span = end - start
    return [int(round(start + i * span / (k - 1))) for i in range(k)]


def hf_hidden_states_index(layer_id: int) -> int:
    """Index into HF `output_hidden_states` of the output of decoder layer `layer_id`."""
    return layer_id + 1


def check_layer_ids(layer_ids: list[int], num_target_layers: int) -> None:
    if not layer_ids:
        raise ValueError("layer ids must not be empty")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"layer ids {layer_ids} repeat an id")
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"layer ids {bad} are outside 0..{num_target_layers - 1} "
            f"for a {num_target_layers}-layer target"
        )
