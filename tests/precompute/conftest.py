"""Fixtures of the precompute tests (helpers live in precompute_helpers.py)."""

from __future__ import annotations

import pytest
from precompute_helpers import chat, write_jsonl


@pytest.fixture()
def mixed_inputs(tmp_path):
    """Two files with good conversations, bad lines and short answers, 24 records in all."""
    a = [chat(i) for i in range(10)] + ["{broken", chat(10, answer_len=2)]
    b = [chat(100 + i) for i in range(9)] + [{"messages": []}, chat(200, answer_len=300)] + [""]
    return [write_jsonl(tmp_path / "a.jsonl", a), write_jsonl(tmp_path / "b.jsonl", b)]
