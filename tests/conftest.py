"""Shared fixtures: the tiny target is built once per test session from a fixed seed (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on the CPU through the interpreter; set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dflash_common.tiny import TinySpec, build_tiny_target  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """An 8-layer, hidden-64 Qwen3 target with a byte-level tokenizer whose template marks assistant
    tokens (`{% generation %}`)."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"), TinySpec())


@pytest.fixture(scope="session")
def tiny_target_2layer(tmp_path_factory):
    """A 2-layer, hidden-64 Qwen3 target (tied embeddings, template without generation markers)."""
    spec = TinySpec(num_layers=2, tie_word_embeddings=True, generation_markers=False, seed=1)
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target-2l"), spec)
