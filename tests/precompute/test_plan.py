"""Shard names and the disk plan."""

from __future__ import annotations

import json

import pytest

from dflash_common.errors import UserError
from precompute import plan as P
from precompute.tokenizing import UnitSummary

from precompute_helpers import make_config, tokenize


def test_shard_names_follow_content_and_state_settings(tiny_target_2layer, mixed_inputs, tmp_path):
    cfg = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "s")
    (summaries, _), _ = tokenize(cfg)
    key = P.state_key("fp", [0, 1], cfg)
    names = [P.unit_shard_name(s.index, s.digest, key) for s in summaries]
    assert len(set(names)) == len(names) and names[0].startswith("u00000000-") and len(names[0]) == 26
    (again, _), _ = tokenize(make_config(tiny_target_2layer, mixed_inputs, tmp_path / "s", "run.tokenize_workers=0"))
    assert [P.unit_shard_name(s.index, s.digest, key) for s in again] == names
    assert P.unit_shard_name(0, summaries[0].digest, P.state_key("fp", [0, 1], cfg)) == names[0]
    assert P.unit_shard_name(0, summaries[1].digest, key) != names[0]  # content, not only the index
    fp8 = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "s", 'store.dtype="fp8_e4m3"')
    assert P.state_key("fp", [0, 1], fp8) != key
    assert P.state_key("fp", [0], cfg) != key and P.state_key("fp2", [0, 1], cfg) != key
    codec = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "s", 'store.codec="zstd"')
    assert P.state_key("fp", [0, 1], codec) == key  # compression does not change the states


def test_bytes_per_token_formula():
    assert P.bytes_per_token(4096, 5, "bf16") == 5 * 8192 + 5
    assert P.bytes_per_token(4096, 5, "fp8_e4m3") == 5 * 4100 + 5
    # q4_hadamard: 2048 bytes of 4-bit codes + 256 group scale bytes + a float32 per token and layer
    assert P.bytes_per_token(4096, 5, "q4_hadamard") == 5 * (2048 + 256 + 4) + 5
    assert P.bytes_per_token(5120, 5, "q4_hadamard") / P.bytes_per_token(5120, 5, "bf16") < 0.30


def _summary(index, tokens, samples):
    return UnitSummary(index, samples, samples, tokens, tokens // 2, 0, {"counts": {}, "examples": []}, "d")


def test_plan_counts_bytes_and_refuses_a_small_disk(tmp_path, monkeypatch):
    summaries = [_summary(0, 1000, 2), _summary(1, 3000, 4)]
    kw = dict(samples_per_unit=4, hidden_size=64, layer_ids=[1, 2], store_dtype="bf16",
              store_path=str(tmp_path / "new" / "store"))
    plan = P.make_plan(summaries, 8, **kw)
    per = 2 * 128 + 5
    assert plan.bytes_total == 4000 * per + (3 + 5) * 8 and plan.units == 2
    assert plan.fits and "enough" in plan.format() and "261 array bytes/token" in plan.format()
    resumed = P.make_plan(summaries, 8, committed={1}, **kw)
    assert resumed.bytes_to_write == 1000 * per + 3 * 8 and resumed.committed_units == 1
    monkeypatch.setattr(P, "free_space", lambda path: 100_000)
    small = P.make_plan(summaries, 8, **kw)
    assert not small.fits and "NOT enough" in small.format()
    with pytest.raises(UserError, match="--run.force=true"):
        P.check_disk(small, force=False)
    P.check_disk(small, force=True)
    json.dumps(small.to_dict())
