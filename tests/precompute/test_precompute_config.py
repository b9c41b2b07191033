from __future__ import annotations

import pytest

from dflash_common.config import ConfigError, iter_fields, load_config
from precompute.config import PrecomputeConfig


def test_defaults_follow_the_dflash_recipe():
    cfg = PrecomputeConfig()
    assert (cfg.data.max_length, cfg.data.block_size, cfg.target.dtype, cfg.target.layer_ids) == (
        3072,
        16,
        "bf16",
        None,
    )
    assert cfg.target.attn_implementation == "sdpa" and cfg.store.dtype == "bf16"


def test_template_kwargs_and_lists_from_the_command_line():
    cfg = load_config(
        PrecomputeConfig,
        None,
        [
            "--data.chat_template_kwargs={enable_thinking = false}",
            "--data.inputs=a.jsonl,b/*.jsonl",
            "--target.layer_ids=1,9,17",
            "--store.dtype=fp8_e4m3",
        ],
    )
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.data.inputs == ["a.jsonl", "b/*.jsonl"] and cfg.target.layer_ids == [1, 9, 17]


@pytest.mark.parametrize(
    "override, names",
    [
        ("--target.layer_ids=[]", "target.layer_ids"),
        ("--target.layer_ids=1,1", "target.layer_ids"),
        ("--target.layer_ids=-1", "target.layer_ids"),
        ("--target.dtype=int8", "target.dtype"),
        ("--data.overlength=wrap", "data.overlength"),
        ("--data.block_size=1", "data.block_size"),
        ("--data.max_length=20", "data.max_length"),
        ("--store.codec=gzip", "store.codec"),
        ("--batching.token_budget=1000", "batching.token_budget"),
        ("--run.samples_per_unit=0", "run.samples_per_unit"),
        ("--run.device=tpu", "run.device"),
    ],
)
def test_bad_values_name_their_field(override, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_config(PrecomputeConfig, None, [override])


def test_every_field_has_help():
    assert all(help for _, _, _, help in iter_fields(PrecomputeConfig))
