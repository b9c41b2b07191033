"""DrafterConfig against the released config.json: built from a target's config (the transformers 4
and 5 layouts), written and read back, z-lab's released layout read, and bad options named."""

from __future__ import annotations

import json

import pytest

from dflash_common.config import ConfigError
from dflash_common.drafter.config import DrafterConfig

from drafter_testlib import TINY_MASK_ID, tiny_config


QWEN3_8B = {  # Qwen3-8B's config.json fields that matter, as transformers 4 wrote them
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def test_from_target_takes_shapes_rope_and_default_layer_ids():
    cfg = DrafterConfig.from_target(QWEN3_8B, mask_token_id=151669)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.num_target_layers) == (5, 16, 36)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        4096,
        32,
        8,
        128,
    )
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.vocab_size == 151936
    assert cfg.layer_types == ("full_attention",) * 5


def test_from_target_reads_transformers5_rope_parameters():
    t5 = {k: v for k, v in QWEN3_8B.items() if not k.startswith("rope")}
    t5["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 5e5,
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    cfg = DrafterConfig.from_target(t5, mask_token_id=151669, depth=3, layer_ids=[2, 5, 8])
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert DrafterConfig.from_config_json(cfg.to_config_json()) == cfg


def test_config_json_round_trip_and_pitfall_fields(tiny_target):
    cfg = tiny_config(tiny_target)
    data = cfg.to_config_json()
    assert DrafterConfig.from_config_json(json.loads(json.dumps(data))) == cfg
    assert data["architectures"] == ["DFlashDraftModel"] and data["model_type"] == "qwen3"
    assert (
        data["block_size"] == 4
        and data["num_target_layers"] == 8
        and data["num_hidden_layers"] == 2
    )
    assert data["dflash_config"]["mask_token_id"] == TINY_MASK_ID
    assert data["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]
    assert data["rope_theta"] == 10000.0 and data["rope_parameters"]["rope_theta"] == 10000.0
    assert data["use_sliding_window"] is True and data["sliding_window"] == 5
    # mixed layers: no global causality key (vLLM's is_causal / dflash_config.causal override every
    # layer); the engines' layer_types rule gives sliding causal, full bidirectional, as trained
    assert "causal" not in data["dflash_config"] and "is_causal" not in data
    assert cfg.layer_causality() == (True, False)
    with pytest.raises(ConfigError, match="causal full_attention"):
        DrafterConfig.from_config_json({**data, "is_causal": True})


@pytest.mark.parametrize(
    "layer_types, causal", [(["full_attention"] * 2, False), (["sliding_attention"] * 2, True)]
)
def test_one_causality_for_all_layers_is_written_where_vllm_reads_it(
    tiny_target, layer_types, causal
):
    window = 5 if causal else None
    data = tiny_config(tiny_target, layer_types=layer_types, sliding_window=window).to_config_json()
    assert data["is_causal"] is causal and data["dflash_config"]["causal"] is causal


def test_an_old_bidirectional_sliding_checkpoint_reads_as_such(tiny_target):
    data = tiny_config(tiny_target).to_config_json()
    old = {**data, "is_causal": False, "dflash_config": {**data["dflash_config"], "causal": False}}
    cfg = DrafterConfig.from_config_json(old)
    assert cfg.sliding_causal is False and cfg.layer_causality() == (False, False)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
        (
            dict(layer_types=["sliding_attention", "full_attention"], sliding_window=None),
            "sliding_window is not set",
        ),
        (dict(mask_token_id=320), "mask_token_id = 320"),
        (dict(layer_ids=[1, 8]), "outside"),
    ],
)
def test_bad_drafter_options_name_the_field(tiny_target, change, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tiny_target, **change)


def test_reads_a_released_z_lab_style_config():
    released = {  # the layout of z-lab's released Qwen3 drafters (transformers 4.57 wrote it)
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "layer_types": ["full_attention"] * 3,
        "max_position_embeddings": 40960,
        "num_attention_heads": 16,
        "num_hidden_layers": 3,
        "num_key_value_heads": 8,
        "num_target_layers": 36,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    cfg = DrafterConfig.from_config_json(released)
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_hidden_layers, cfg.rope_theta) == (
        16,
        151669,
        3,
        1e6,
    )
    written = cfg.to_config_json()
    assert all(written[k] == v for k, v in released.items() if k != "dflash_config"), (
        "a field changed"
    )
    # all full layers: bidirectional said explicitly, where vLLM reads it first
    assert written["dflash_config"] == {**released["dflash_config"], "causal": False}
    del released["num_target_layers"]
    with pytest.raises(ConfigError, match="num_target_layers"):
        DrafterConfig.from_config_json(released)
