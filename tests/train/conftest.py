"""Session fixtures of the trainer's tests: tiny stores written once per test session."""

from __future__ import annotations

import pytest
from train_helpers import write_tiny_store


@pytest.fixture(scope="session")
def tiny_store(tiny_target, tmp_path_factory):
    """6 shards x 8 conversations, bf16 states of layers 1-5 of the tiny target."""
    return write_tiny_store(tmp_path_factory.mktemp("stores") / "tiny-bf16", tiny_target)


@pytest.fixture(scope="session")
def tiny_store_fp8(tiny_target, tmp_path_factory):
    """4 shards x 8 other conversations, fp8 e4m3 states (per-token scales) of layers 1-5."""
    return write_tiny_store(tmp_path_factory.mktemp("stores") / "tiny-fp8", tiny_target, n_shards=4,
                            dtype="fp8_e4m3", first_record=48)
