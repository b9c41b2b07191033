"""The target's embedding and lm_head read from safetensors equal what transformers loads."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_common.errors import UserError
from dflash_common.drafter.target_head import load_target_head


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_untied_target_gives_its_embedding_and_lm_head(tiny_target):
    head = load_target_head(tiny_target)
    model = _hf(tiny_target)
    assert not head.tied
    assert torch.equal(head.embed, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head, model.lm_head.weight)
    assert not torch.equal(head.embed, head.lm_head)


def test_tied_target_gives_the_embedding_twice(tiny_target_2layer):
    head = load_target_head(tiny_target_2layer, dtype=torch.bfloat16)
    assert head.tied and head.lm_head is head.embed and head.embed.dtype == torch.bfloat16
    assert torch.equal(head.embed, _hf(tiny_target_2layer).get_input_embeddings().weight.bfloat16())


def test_sharded_target_reads_only_through_the_index(tiny_target, tmp_path):
    model = _hf(tiny_target)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    head = load_target_head(tmp_path)
    assert torch.equal(head.embed, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head, model.lm_head.weight)


def test_missing_weights_are_one_clear_error(tiny_target, tmp_path):
    (tmp_path / "config.json").write_text((tiny_target / "config.json").read_text())
    with pytest.raises(UserError, match="neither model.safetensors nor"):
        load_target_head(tmp_path)
    with pytest.raises(UserError, match="no config.json"):
        load_target_head(tmp_path / "nowhere")
