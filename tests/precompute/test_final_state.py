"""store.final_state: the target's final normed hidden state, checked against HF's hidden_states[-1]
and its logits through the lm_head, then written by a real job beside the layers (same layer bits
as a job without it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_common.store import Store
from precompute import job
from precompute import target as T

from precompute_helpers import demo_inputs, job_overrides, make_config


@pytest.fixture(scope="module")
def full_tiny(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def test_final_state_is_hf_last_hidden_state_and_gives_the_logits(tiny_target, full_tiny):
    t = T.load_target(tiny_target, [1, 3], dtype="fp32", final_state=True)
    assert t.state_keys == [1, 3, T.FINAL] and len(t.model.layers) == 8  # every layer runs
    ids = torch.randint(0, 256, (2, 25), generator=torch.Generator().manual_seed(3))
    layer_1, layer_3, final = t.forward(ids)
    with torch.no_grad():
        out = full_tiny(ids, output_hidden_states=True)
    torch.testing.assert_close(layer_3, out.hidden_states[4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, out.hidden_states[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        final @ full_tiny.lm_head.weight.detach().T, out.logits, rtol=1e-4, atol=1e-4
    )
    assert not [n for n, _ in t.model.named_parameters() if "lm_head" in n]  # still no lm_head


def test_a_job_stores_final_states_beside_unchanged_layers(tiny_target, full_tiny, tmp_path):
    inputs = demo_inputs(tmp_path)
    plain, with_final = tmp_path / "plain", tmp_path / "final"
    job.run(
        make_config(
            tiny_target,
            inputs,
            plain,
            *job_overrides("bf16", samples_per_unit=24),
            "target.dtype=fp32",
        )
    )
    job.run(
        make_config(
            tiny_target,
            inputs,
            with_final,
            *job_overrides("bf16", samples_per_unit=24),
            "target.dtype=fp32",
            "store.final_state=true",
        )
    )
    a, b = Store.open(plain), Store.open(with_final)
    assert b.manifest.final_state and not a.manifest.final_state
    name_a, name_b = a.shard_names()[0], b.shard_names()[0]
    assert name_a != name_b  # the state key names what the shard holds
    da, db = a.read_shard(name_a), b.read_shard(name_b)
    for layer_id in a.manifest.layer_ids:
        assert np.array_equal(da.layers[layer_id], db.layers[layer_id])  # same batches, same bits
    seq = torch.from_numpy(db.input_ids[db.offsets[0] : db.offsets[1]].astype(np.int64))[None]
    with torch.no_grad():
        want = full_tiny(seq, output_hidden_states=True).hidden_states[-1][0]
    got = db.states(None, out_dtype=torch.float32)[: seq.shape[1]]
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)  # bf16 storage of an fp32 target
