"""Session fixtures of the trainer's tests: tiny stores written once per test session."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from dflash_common.drafter.config import DrafterConfig
from dflash_common.drafter.export import save_drafter
from dflash_common.drafter.model import DFlashDrafter
from dflash_common.tiny import MASK_TOKEN

from train_helpers import write_tiny_store

EVAL_BLOCK = 4  # block size of the untrained drafter the eval tests export


@pytest.fixture(scope="session")
def tiny_store(tiny_target, tmp_path_factory):
    """6 shards x 8 conversations, bf16 states of layers 1-5 of the tiny target."""
    return write_tiny_store(tmp_path_factory.mktemp("stores") / "tiny-bf16", tiny_target)


@pytest.fixture(scope="session")
def tiny_store_fp8(tiny_target, tmp_path_factory):
    """4 shards x 8 other conversations, fp8 e4m3 states (per-token scales) of layers 1-5."""
    return write_tiny_store(tmp_path_factory.mktemp("stores") / "tiny-fp8", tiny_target, n_shards=4,
                            dtype="fp8_e4m3", first_record=48)


@pytest.fixture(scope="session")
def tiny_store_q4(tiny_target, tmp_path_factory):
    """tiny_store's 6 shards x 8 conversations as q4_hadamard states: the same shard names and
    sequences, so a run from it draws the same batches and anchors as one from tiny_store."""
    return write_tiny_store(tmp_path_factory.mktemp("stores") / "tiny-q4", tiny_target, dtype="q4_hadamard")


@pytest.fixture(scope="session")
def tiny_store_final(tiny_target, tmp_path_factory):
    """4 shards x 8 conversations, bf16 states of layers 1-5 and the final normed state."""
    return write_tiny_store(tmp_path_factory.mktemp("stores") / "tiny-final", tiny_target, n_shards=4,
                            final_state=True)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices gain nothing from a second thread and lose much when the two cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory):
    """An untrained (random) DFlash drafter for the tiny target (depth 2, block EVAL_BLOCK), exported in
    the released layout."""
    mask = AutoTokenizer.from_pretrained(tiny_target).convert_tokens_to_ids(MASK_TOKEN)
    cfg = DrafterConfig.from_target(AutoConfig.from_pretrained(tiny_target), mask_token_id=mask, depth=2,
                                    block_size=EVAL_BLOCK)
    torch.manual_seed(0)
    return save_drafter(DFlashDrafter(cfg), tmp_path_factory.mktemp("drafter") / "export", dtype=torch.bfloat16)
