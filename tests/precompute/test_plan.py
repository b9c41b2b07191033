"""Work units, tokenization with the length rules, the token cache, shard names and the disk plan."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_common.cli import UserError
from precompute import plan as P
from precompute.inputs import RawRecord, resolve_inputs

from precompute_helpers import chat, make_config, write_jsonl


def tokenize(cfg, rank=0, world=1):
    sources = resolve_inputs(cfg.data.inputs)
    cache = P.TokenCache.for_config(cfg, sources)
    return P.tokenize_units(cfg, sources, cache, rank, world), cache


def test_units_are_cut_by_input_order_and_never_depend_on_world_size(tiny_target_2layer, mixed_inputs, tmp_path):
    cfg = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "store")
    (one, records), _ = tokenize(cfg)
    assert records == 24 and [s.index for s in one] == list(range(6))
    assert [s.records for s in one] == [4] * 6
    for world in (2, 3):
        parts = []
        for rank in range(world):
            (mine, n), _ = tokenize(cfg, rank, world)
            assert n == 24 and all(P.owner(s.index, world, cfg.batching.sort_window_units) == rank for s in mine)
            parts += mine
        assert sorted(parts, key=lambda s: s.index) == one


def test_ranks_own_whole_windows_round_robin():
    assert [P.owner(u, 2, 3) for u in range(10)] == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1]
    assert [P.owner(u, 3) for u in range(4)] == [0, 1, 2, 0]
    assert all(P.owner(u, 1, 4) == 0 for u in range(9))


def test_length_rules_and_skip_reasons(tiny_target_2layer, mixed_inputs, tmp_path):
    cfg = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "s")
    (summaries, _), cache = tokenize(cfg)
    plan = P.make_plan(summaries, 24, samples_per_unit=4, hidden_size=64, layer_ids=[0, 1],
                       store_dtype="bf16", store_path=str(tmp_path))
    assert dict(plan.skips.counts) == {"malformed_json": 1, "too_few_response_tokens": 1,
                                       "empty_conversation": 1, "blank_line": 1}
    assert plan.samples == 20 and plan.truncated == 1  # the 300-character answer is cut to 256 tokens
    text = plan.format()  # the first few skips of the whole input, in input order, with file and line
    assert "e.g. skipped a.jsonl:11: malformed_json" in text  # the file by its name
    assert text.index("a.jsonl:12") < text.index("b.jsonl:10")
    unit = cache.load(5)
    assert unit.sample_ids == ["b.jsonl:9", "b.jsonl:11"]
    assert unit.lengths()[1] == 256
    dropped = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "s2", 'data.overlength="drop"')
    (summaries, _), _ = tokenize(dropped)
    assert sum(s.samples for s in summaries) == 19
    assert sum(s.skips["counts"].get("too_long", 0) for s in summaries) == 1


def test_a_unit_holds_exactly_the_template_tokens(tiny_target_2layer, tmp_path):
    from dflash_common.chat import ChatTemplate
    from transformers import AutoTokenizer

    inputs = [write_jsonl(tmp_path / "a.jsonl", [chat(0), chat(1, 60)])]
    cfg = make_config(tiny_target_2layer, inputs, tmp_path / "s")
    _, cache = tokenize(cfg)
    unit = cache.load(0)
    template = ChatTemplate(AutoTokenizer.from_pretrained(tiny_target_2layer))
    for n, record in enumerate([chat(0), chat(1, 60)]):
        ids, mask = template.tokenize(record["messages"])
        a, b = unit.offsets[n], unit.offsets[n + 1]
        np.testing.assert_array_equal(unit.input_ids[a:b], ids)
        np.testing.assert_array_equal(unit.loss_mask[a:b], mask)
    assert unit.input_ids.dtype == np.int32 and unit.loss_mask.dtype == np.uint8
    assert int(unit.loss_mask[unit.offsets[0]:unit.offsets[1]].sum()) == 41


def test_pre_tokenized_records_are_checked_against_the_vocabulary(tiny_target_2layer, tmp_path):
    good = {"input_ids": list(range(40)), "loss_mask": [0] * 10 + [1] * 30}
    bad = {"input_ids": [5, 100000] + [1] * 38, "loss_mask": [1] * 40}
    cfg = make_config(tiny_target_2layer, [write_jsonl(tmp_path / "t.jsonl", [good, bad])], tmp_path / "s")
    (summaries, _), cache = tokenize(cfg)
    assert summaries[0].samples == 1 and summaries[0].skips["counts"] == {"token_id_out_of_range": 1}
    np.testing.assert_array_equal(cache.load(0).input_ids, np.arange(40))


def test_cache_is_reused_and_invalidated_by_changed_inputs(tiny_target_2layer, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(6)])
    cfg = make_config(tiny_target_2layer, [path], tmp_path / "s")
    (first, _), cache = tokenize(cfg)
    calls = []
    real = P.UnitTokenizer.__call__
    monkeypatch.setattr(P.UnitTokenizer, "__call__", lambda self, u, r: calls.append(u) or real(self, u, r))
    (again, _), cache2 = tokenize(cfg)
    assert again == first and calls == [] and cache2.root == cache.root
    write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(7)])
    (grown, _), cache3 = tokenize(cfg)
    assert cache3.root != cache.root and calls == [0, 1] and grown[0] == first[0]
    other = make_config(tiny_target_2layer, [path], tmp_path / "s", "data.chat_template_kwargs={enable_thinking=false}")
    assert P.TokenCache.for_config(other, resolve_inputs([path])).root != cache3.root


def test_cache_key_follows_the_tokenizer_and_chat_template(tiny_target_2layer, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_target_2layer, copy)
    same = P.tokenizer_identity(str(copy))
    assert same == P.tokenizer_identity(str(tiny_target_2layer))
    template = copy / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
    changed = P.tokenizer_identity(str(copy))
    assert changed["chat_template_sha256"] != same["chat_template_sha256"]
    assert changed["tokenizer"] == same["tokenizer"]
    cfg = make_config(copy, ["x"], tmp_path / "s")
    assert P.TokenCache.for_config(cfg, [], changed).root != P.TokenCache.for_config(cfg, [], same).root


def test_process_pool_tokenizes_the_same_units(tiny_target_2layer, mixed_inputs, tmp_path):
    inline = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "a")
    pooled = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "b", "run.tokenize_workers=2")
    (want, _), _ = tokenize(inline)
    (got, _), cache = tokenize(pooled)
    assert got == want and cache.root.parent == tmp_path / "b.tokens"


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
    return P.UnitSummary(index, samples, samples, tokens, tokens // 2, 0, {"counts": {}, "examples": []}, "d")


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


_content = st.text(max_size=30) | st.sampled_from(["<|im_end|>", "<|im_start|>", "\x00", "{% raw %}", "ü" * 20])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(st.sampled_from(["user", "assistant", "system", "tool"]), _content), max_size=5),
       plain=st.booleans())
def test_fuzz_tokenizing_never_crashes_and_counts_every_skip(turns, plain, tiny_target, tiny_target_2layer, tmp_path):
    target = tiny_target_2layer if plain else tiny_target
    cfg = make_config(target, ["unused"], tmp_path / "s", "data.block_size=2", "data.max_length=64")
    tokenizer = _tokenizers.setdefault(plain, P.UnitTokenizer.from_target(str(target), cfg.data))
    record = json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}).encode()
    unit = tokenizer(0, [RawRecord(0, "fuzz:1", record)])
    assert unit.num_samples + unit.skips.total == 1
    if unit.num_samples:
        assert unit.num_tokens <= 64 and unit.loss_mask.sum() >= 4


_tokenizers: dict = {}
