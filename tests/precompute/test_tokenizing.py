"""Tokenization with the length rules and its skip reasons, and the token cache."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precompute import plan as P
from precompute import tokenizing as T
from precompute.inputs import RawRecord, resolve_inputs

from precompute_helpers import chat, make_config, tokenize, write_jsonl


def test_length_rules_and_skip_reasons(tiny_target_2layer, mixed_inputs, tmp_path):
    cfg = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "s")
    (summaries, _), cache = tokenize(cfg)
    plan = P.make_plan(
        summaries,
        24,
        samples_per_unit=4,
        hidden_size=64,
        layer_ids=[0, 1],
        store_dtype="bf16",
        store_path=str(tmp_path),
    )
    assert dict(plan.skips.counts) == {
        "malformed_json": 1,
        "too_few_response_tokens": 1,
        "empty_conversation": 1,
        "blank_line": 1,
    }
    assert (
        plan.samples == 20 and plan.truncated == 1
    )  # the 300-character answer is cut to 256 tokens
    text = (
        plan.format()
    )  # the first few skips of the whole input, in input order, with file and line
    assert "e.g. skipped a.jsonl:11: malformed_json" in text  # the file by its name
    assert text.index("a.jsonl:12") < text.index("b.jsonl:10")
    unit = cache.load(5)
    assert unit.sample_ids == ["b.jsonl:9", "b.jsonl:11"]
    assert unit.lengths()[1] == 256
    dropped = make_config(
        tiny_target_2layer, mixed_inputs, tmp_path / "s2", 'data.overlength="drop"'
    )
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
    assert int(unit.loss_mask[unit.offsets[0] : unit.offsets[1]].sum()) == 41


def test_pre_tokenized_records_are_checked_against_the_vocabulary(tiny_target_2layer, tmp_path):
    good = {"input_ids": list(range(40)), "loss_mask": [0] * 10 + [1] * 30}
    bad = {"input_ids": [5, 100000] + [1] * 38, "loss_mask": [1] * 40}
    cfg = make_config(
        tiny_target_2layer, [write_jsonl(tmp_path / "t.jsonl", [good, bad])], tmp_path / "s"
    )
    (summaries, _), cache = tokenize(cfg)
    assert summaries[0].samples == 1 and summaries[0].skips["counts"] == {
        "token_id_out_of_range": 1
    }
    np.testing.assert_array_equal(cache.load(0).input_ids, np.arange(40))


def test_cache_is_reused_and_invalidated_by_changed_inputs(
    tiny_target_2layer, tmp_path, monkeypatch
):
    path = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(6)])
    cfg = make_config(tiny_target_2layer, [path], tmp_path / "s")
    (first, _), cache = tokenize(cfg)
    calls = []
    real = T.UnitTokenizer.__call__
    monkeypatch.setattr(
        T.UnitTokenizer, "__call__", lambda self, u, r: calls.append(u) or real(self, u, r)
    )
    (again, _), cache2 = tokenize(cfg)
    assert again == first and calls == [] and cache2.root == cache.root
    write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(7)])
    (grown, _), cache3 = tokenize(cfg)
    assert cache3.root != cache.root and calls == [0, 1] and grown[0] == first[0]
    other = make_config(
        tiny_target_2layer,
        [path],
        tmp_path / "s",
        "data.chat_template_kwargs={enable_thinking=false}",
    )
    assert T.TokenCache.for_config(other, resolve_inputs([path])).root != cache3.root


def test_cache_key_follows_the_tokenizer_and_chat_template(tiny_target_2layer, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_target_2layer, copy)
    same = T.tokenizer_identity(str(copy))
    assert same == T.tokenizer_identity(str(tiny_target_2layer))
    template = copy / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
    changed = T.tokenizer_identity(str(copy))
    assert changed["chat_template_sha256"] != same["chat_template_sha256"]
    assert changed["tokenizer"] == same["tokenizer"]
    cfg = make_config(copy, ["x"], tmp_path / "s")
    assert (
        T.TokenCache.for_config(cfg, [], changed).root
        != T.TokenCache.for_config(cfg, [], same).root
    )


def test_process_pool_tokenizes_the_same_units(tiny_target_2layer, mixed_inputs, tmp_path):
    inline = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "a")
    pooled = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "b", "run.tokenize_workers=2")
    (want, _), _ = tokenize(inline)
    (got, _), cache = tokenize(pooled)
    assert got == want and cache.root.parent == tmp_path / "b.tokens"


_content = st.text(max_size=30) | st.sampled_from(
    ["<|im_end|>", "<|im_start|>", "\x00", "{% raw %}", "ü" * 20]
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["user", "assistant", "system", "tool"]), _content), max_size=5
    ),
    plain=st.booleans(),
)
def test_fuzz_tokenizing_never_crashes_and_counts_every_skip(
    turns, plain, tiny_target, tiny_target_2layer, tmp_path
):
    target = tiny_target_2layer if plain else tiny_target
    cfg = make_config(target, ["unused"], tmp_path / "s", "data.block_size=2", "data.max_length=64")
    tokenizer = _tokenizers.setdefault(plain, T.UnitTokenizer.from_target(str(target), cfg.data))
    record = json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}).encode()
    unit = tokenizer(0, [RawRecord(0, "fuzz:1", record)])
    assert unit.num_samples + unit.skips.total == 1
    if unit.num_samples:
        assert unit.num_tokens <= 64 and unit.loss_mask.sum() >= 4


_tokenizers: dict = {}
