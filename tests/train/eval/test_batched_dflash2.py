"""A DFlash2 drafter in dflash-eval's batched loop (train/eval/batched.py): its convolutions over
each row's block and its selector's walk through the candidates draft as one prompt at a time does,
so every prompt's tokens and cycles are the one-at-a-time loop's (float32), and lossless."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_evaluate_dflash import BLOCK, _briefly_trained_drafter
from eval_helpers import batched_decodes_as_one_at_a_time
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_common.drafter.arch import as_arch
from dflash_common.drafter.dflash2 import DFlash2Drafter
from train.eval import batched
from train.eval.prompts import load_prompts
from train.eval.spec_decode import DFlashProposer

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dflash2(model, tiny_target):
    """A briefly trained DFlash drafter's weights in a DFlash2 drafter whose convolutions mix the
    rows before each one (3 taps) and whose selector picks other candidates than the top-1 at many
    positions: drafts still accepted, and a wrong block length or walk would change them."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    base = _briefly_trained_drafter(model, tok, ROOT, steps=30)
    cfg = as_arch(
        base.cfg,
        "dflash2",
        conv_kernel_size=3,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=4,
    )
    torch.manual_seed(1)
    drafter = DFlash2Drafter(cfg)
    _, unexpected = drafter.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 1:].normal_(0.0, 0.1)
                conv.kernel_projection.weight.normal_(0.0, 0.05)
        selector = drafter.candidate_selector
        selector.predecessor_codebook.normal_(0.0, 1.0)
        selector.successor_codebook.normal_(0.0, 0.1)
        selector.hidden_projection.weight.normal_(0.0, 0.3)
    drafter.attach_frozen(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return drafter.eval()


def test_batched_dflash2_decoding_has_the_one_at_a_time_cycles(model, tiny_target, dflash2):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    prompts = [p.ids for p in load_prompts([str(ROOT / "data" / "tiny-prompts.jsonl")], tok, {})]
    proposer = DFlashProposer(dflash2)
    assert batched.batchable(proposer)
    walked = []  # per draft step: how many drafts differ from each position's argmax
    draft = proposer.draft

    def counting(block_hidden, anchors):
        out = draft(block_hidden, anchors)
        walked.append(int((out != dflash2.logits(block_hidden[:, 1:]).argmax(-1)).sum()))
        return out

    proposer.draft = counting
    single = batched_decodes_as_one_at_a_time(model, proposer, prompts, BLOCK)
    seen = [n for a in single for n in a.acceptance_lengths]
    assert max(seen) >= 3, "the drafter should get drafts accepted for the check to bite"
    assert sum(walked) > 0, "the selector should draft other tokens than the argmax"
