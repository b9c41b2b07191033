"""Fixtures of the precompute tests (helpers live in precompute_helpers.py)."""

from __future__ import annotations

import pytest
import torch
from precompute_helpers import chat, write_jsonl


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tiny target's ops are small: on a small shared CPU box an intra-op pool spanning every
    core stalls on them (10-60x slower), so precompute tests run on one thread, as torchrun's
    workers do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def mixed_inputs(tmp_path):
    """Two files with good conversations, bad lines and short answers, 24 records in all."""
    a = [chat(i) for i in range(10)] + ["{broken", chat(10, answer_len=2)]
    b = [chat(100 + i) for i in range(9)] + [{"messages": []}, chat(200, answer_len=300)] + [""]
    return [write_jsonl(tmp_path / "a.jsonl", a), write_jsonl(tmp_path / "b.jsonl", b)]


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    """A Qwen3.5-architecture vision-language checkpoint
    (hybrid linear/full attention text tower)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision)
    ).eval()
    path = tmp_path_factory.mktemp("tiny-vlm")
    model.save_pretrained(path)
    return path, model
