"""dflash-generate on the tiny target: batched decoding equals one-at-a-time decoding (and plain
`model.generate`), inputs of every kind become regenerated conversations, reruns resume, two gloo
ranks write the files one rank writes, cut answers are kept or dropped, and dflash-precompute reads
the output."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_common.errors import UserError
from dflash_common.config import load_config
from dflash_common.sampling import Sampling
from precompute.generate import job
from dflash_common.chat import assistant_message
from precompute.generate.chats import split_turns
from precompute.generate.config import GenerateConfig
from precompute.generate.decode import Request, TransformersDecoder, batch_requests
from precompute.inputs import resolve_inputs

from precompute_helpers import ROOT, subprocess_env, write_jsonl

PROMPTS = ["hi", "tell me about owls and their long history", "x" * 30, "why?", "bees " * 9]


def _model(target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    return model, tok, [tok(t, add_special_tokens=False)["input_ids"] for t in ids]


def _decoder(model, stop, sampling, budget=10_000):
    return TransformersDecoder(model, stop, 256, sampling, token_budget=budget, max_batch=8)


def test_batched_greedy_is_one_at_a_time_greedy_and_model_generate(tiny_target):
    model, _, prompts = _model(tiny_target)
    s = Sampling(0.0, 1.0, 0, 24, 0)
    alone = [_decoder(model, {258}, s).decode_batch([Request(p, 0)])[0] for p in prompts]
    for p, a in zip(prompts, alone):  # the reference computed another way: transformers' own loop
        ref = model.generate(
            torch.tensor([p]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=258,
            pad_token_id=256,
        )[0, len(p) :].tolist()
        assert a.tokens == [t for t in ref if t != 258][: len(a.tokens)] and len(ref) >= len(
            a.tokens
        )
    stop = {alone[1].tokens[5]}  # a token the second answer emits: rows stop at different steps
    alone = [_decoder(model, stop, s).decode_batch([Request(p, 0)])[0] for p in prompts]
    batched = _decoder(model, stop, s).decode_batch([Request(p, 0) for p in prompts])
    assert batched == alone
    assert alone[1].finish_reason == "stop" and len(alone[1].tokens) <= 5
    assert {a.finish_reason for a in alone} == {"stop", "length"}
    split = _decoder(model, stop, s, budget=2 * (len(prompts[1]) + 24)).generate(
        [Request(p, 0) for p in prompts]
    )
    assert split == alone  # several batches, sorted by length, answers back in request order


def _sliding_model(tiny_target):
    """The tiny target with its first layer made sliding-window
    (window 4): a 4D full mask would be wrong."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_target)
    config.layer_types = ["sliding_attention"] + ["full_attention"] * (config.num_hidden_layers - 1)
    config.sliding_window, config.use_sliding_window = 4, True
    return AutoModelForCausalLM.from_pretrained(
        tiny_target, config=config, dtype=torch.float32
    ).eval()


def test_static_decode_steps_match_grown_mask_steps_and_sliding_targets_fall_back(tiny_target):
    model, _, prompts = _model(tiny_target)
    s = Sampling(0.0, 1.0, 0, 20, 0)
    static = _decoder(model, {258}, s)
    grown = _decoder(model, {258}, s)
    grown.static_steps = (
        False  # the 2D mask grown each step: the other formulation of the same step
    )
    assert static.static_steps and not static.cuda_graphs  # a CPU: the static step runs eagerly
    requests = [Request(p, 0) for p in prompts]  # five lengths: left padding differs by row
    assert static.decode_batch(requests) == grown.decode_batch(requests)

    sliding = _sliding_model(tiny_target)
    decoder = _decoder(sliding, {258}, s)
    assert (
        not decoder.static_steps
    )  # a full 4D mask would let the sliding layer see past its window
    refs = [
        [
            t
            for t in sliding.generate(
                torch.tensor([p]),
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=258,
                pad_token_id=256,
            )[0, len(p) :].tolist()
            if t != 258
        ]
        for p in prompts
    ]
    for a, ref in zip(
        decoder.decode_batch(requests), refs
    ):  # it still decodes as transformers does
        assert a.tokens == ref[: len(a.tokens)]


def test_packed_gqa_decode_attention_equals_attention_over_repeated_heads():
    """One query token, 8 query heads over 2 key/value heads, a padding mask per row: the packed
    attention equals softmax(q k^T / sqrt(D) + mask) v with each query head on its own group's cache
    (written out here), and a longer query goes to transformers' sdpa unchanged."""
    from precompute.generate.attention import packed_gqa_sdpa

    class Attn:
        num_key_value_groups = 4

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape, generator=g) for shape in ((3, 8, 1, 16), (3, 2, 20, 16), (3, 2, 20, 16))
    )
    mask = torch.zeros(3, 1, 1, 20)
    mask[0, ..., :5] = mask[2, ..., 17:] = torch.finfo(torch.float32).min
    got, _ = packed_gqa_sdpa(Attn(), q, k, v, mask, scaling=0.25)
    kr, vr = (
        k.repeat_interleave(4, dim=1),
        v.repeat_interleave(4, dim=1),
    )  # head h reads group h // 4
    want = ((q @ kr.transpose(-1, -2)) * 0.25 + mask).softmax(-1) @ vr  # [3, 8, 1, 16]
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    q2 = torch.randn(3, 8, 4, 16, generator=g)
    got2, _ = packed_gqa_sdpa(Attn(), q2, k, v, None, scaling=0.25, is_causal=False)
    want2 = ((q2 @ kr.transpose(-1, -2)) * 0.25).softmax(-1) @ vr
    torch.testing.assert_close(got2, want2.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_decoding_switches_the_attention_only_while_it_runs(tiny_target, monkeypatch):
    """decode_batch runs every one-token step of the (GQA) tiny target through the packed attention
    and leaves the caller's model on sdpa afterwards."""
    import precompute.generate.attention as D

    model, _, prompts = _model(tiny_target)
    calls = []
    real = D.packed_gqa_sdpa
    monkeypatch.setattr(
        D, "packed_gqa_sdpa", lambda *a, **k: calls.append(a[1].shape[2]) or real(*a, **k)
    )
    out = _decoder(model, {-1}, Sampling(0.0, 1.0, 0, 6, 0)).decode_batch(
        [Request(p, 0) for p in prompts]
    )
    assert all(len(o.tokens) == 6 for o in out)
    layers = model.config.num_hidden_layers
    assert (
        calls.count(1) == 5 * layers and len(calls) == 6 * layers
    )  # 5 steps after the prefill, every layer
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.gpu
def test_cuda_graph_steps_give_the_eager_steps_tokens(tiny_target):
    model, _, prompts = _model(tiny_target)
    model = model.cuda()
    for s in (Sampling(0.0, 1.0, 0, 24, 0), Sampling(1.0, 0.9, 50, 24, 0)):
        requests = [Request(p, 100 + i) for i, p in enumerate(prompts)]
        # a warm-up forward before the first graph capture would write every later step's keys one
        # slot late
        graphs = TransformersDecoder(
            model, {258}, 256, s, token_budget=10_000, max_batch=8, cuda_graphs=True
        )
        eager = _decoder(model, {258}, s)
        assert graphs.cuda_graphs and not eager.cuda_graphs
        assert graphs.decode_batch(requests) == eager.decode_batch(requests)
        assert graphs.generate(requests) == eager.generate(
            requests
        )  # a second batch captures its own graph


@pytest.mark.gpu
def test_compiled_cuda_graph_steps_give_the_eager_steps_tokens(tiny_target):
    """generate.compile on the GPU: the causal LM's decoder layers compiled, graphs over them
    (float32, so the fused kernels round as eager ones do)."""
    model, _, prompts = _model(tiny_target)
    eager = _decoder(model.cuda(), {258}, Sampling(0.0, 1.0, 0, 24, 0))
    requests = [Request(p, 100 + i) for i, p in enumerate(prompts)]
    want = eager.generate(requests)
    compiled_model, _, _ = _model(tiny_target)
    compiled = TransformersDecoder(
        compiled_model.cuda(),
        {258},
        256,
        Sampling(0.0, 1.0, 0, 24, 0),
        token_budget=10_000,
        max_batch=8,
        compile=True,
        cuda_graphs=True,
    )
    assert compiled.generate(requests) == want


def test_sampled_answers_do_not_depend_on_the_batch(tiny_target):
    model, _, prompts = _model(tiny_target)
    s = Sampling(1.0, 0.9, 50, 16, 0)
    requests = [Request(p, 1000 + i) for i, p in enumerate(prompts)]
    batched = _decoder(model, {258}, s).decode_batch(requests)
    assert batched == [_decoder(model, {258}, s).decode_batch([r])[0] for r in requests]
    other = _decoder(model, {258}, s).decode_batch([Request(p, 7) for p in prompts])
    assert other != batched  # the seed matters


def test_batches_are_length_sorted_and_within_budget():
    lengths = [5, 50, 7, 49, 6]
    batches = batch_requests(lengths, 10, token_budget=120, max_batch=8)
    assert batches == [[1, 3], [2, 4, 0]]
    assert all(len(b) * (lengths[b[0]] + 10) <= 120 for b in batches)


def test_turns_and_thinking_are_split_as_documented():
    conv = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "c"},
    ]
    assert split_turns(conv, "all") == ([], [conv[:2], [conv[3]], [conv[5]]])
    assert split_turns(conv, "last") == (conv, [[]])
    assert split_turns(conv[:5], "last") == (conv[:4], [[]])
    assert assistant_message("<think>\nhmm\n</think>\n\nyes") == {
        "role": "assistant",
        "content": "yes",
        "reasoning_content": "hmm",
    }


# ------------------------------------------------------------------------------------ the job


@pytest.fixture(scope="module")
def chatty_target(tiny_target, tmp_path_factory):
    """The tiny target whose generation_config also stops on every even byte: answers end early with
    'stop', so multi-turn conversations get every turn answered."""
    path = tmp_path_factory.mktemp("chatty") / "target"
    shutil.copytree(tiny_target, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [258] + list(range(0, 256, 2))
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def _conv(i, turns=2):
    msgs = [{"role": "system", "content": "be brief"}]
    for k in range(turns):
        msgs += [
            {"role": "user", "content": f"question {i}.{k}?"},
            {"role": "assistant", "content": f"old {i}.{k}"},
        ]
    return {"id": f"c{i}", "messages": msgs}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen-inputs")
    a = [
        _conv(0),
        {"prompt": "owls?"},
        "{broken",
        _conv(1, 1),
        {"input_ids": [1, 2], "loss_mask": [0, 1]},
        {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "old"}]},
    ]
    write_jsonl(d / "a.jsonl", a)
    (d / "b.txt").write_text("first prompt\nsecond prompt\n\nfourth prompt\n")
    return [str(d / "a.jsonl"), str(d / "b.txt")]


def _cfg(target, inputs, out, *overrides):
    args = [
        f"--target.path={json.dumps(str(target))}",
        f"--data.inputs={json.dumps(inputs)}",
        f"--output.dir={json.dumps(str(out))}",
        "--target.dtype=fp32",
        "--run.device=cpu",
        "--run.samples_per_unit=2",
        "--generate.sort_window_units=1",
        "--sampling.max_new_tokens=12",
        "--run.progress=false",
    ]
    return load_config(GenerateConfig, None, args + [f"--{o}" for o in overrides])


def _files(out: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("u*.jsonl"))
    }


def _records(out: Path) -> dict[str, dict]:
    return {
        r["id"]: r
        for p in sorted(out.glob("u*.jsonl"))
        for r in map(json.loads, p.read_text().splitlines())
    }


@pytest.fixture(scope="module")
def one_rank(chatty_target, inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "gen"
    job.run(_cfg(chatty_target, inputs, out))
    return out


def test_every_input_kind_is_answered_and_bad_records_are_counted(one_rank):
    manifest = json.loads((one_rank / "manifest.json").read_text())
    assert manifest["units"] == 5 and len(_files(one_rank)) == 5  # 10 records, 2 per unit
    assert manifest["skips"]["counts"] == {"blank_line": 1, "malformed_json": 1, "pre_tokenized": 1}
    records = _records(one_rank)
    assert len(records) == 7 and manifest["counts"]["conversations"] == 7
    two = records["c0"]
    assert [m["role"] for m in two["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert two["generated_turns"] == 2 and all(
        not m["content"].startswith("old") for m in two["messages"] if m["role"] == "assistant"
    )
    fourth = [r for k, r in records.items() if k.endswith("b.txt:4")][0]
    assert fourth["messages"] == [
        {"role": "user", "content": "fourth prompt"},
        fourth["messages"][1],
    ]
    assert sum(manifest["finish_reasons"].values()) == manifest["counts"]["turns"] == 8
    assert (
        manifest["settings"]["sampling"]["temperature"] == 0.0
    )  # from generation_config.json: greedy


def test_turns_last_keeps_the_history_and_answers_the_final_turn(
    chatty_target, inputs, one_rank, tmp_path
):
    out = tmp_path / "last"
    job.run(_cfg(chatty_target, inputs, out, "generate.turns=last"))
    assert torch.is_grad_enabled()  # the job ran in this process and left autograd as it found it
    last, every = _records(out)["c0"], _records(one_rank)["c0"]
    assert last["generated_turns"] == 1 and last["messages"][2] == {
        "role": "assistant",
        "content": "old 0.0",
    }
    assert last["messages"][-1]["content"] != "old 0.1"
    assert _files(out).keys().isdisjoint(_files(one_rank).keys())  # the settings are in the names
    assert every["messages"][2]["content"] != "old 0.0"


def test_a_rerun_resumes_and_gives_the_same_files(chatty_target, inputs, one_rank, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(one_rank, out)
    first = sorted(out.glob("u*.jsonl"))[1]
    first.unlink()
    job.run(_cfg(chatty_target, inputs, out))
    assert _files(out) == _files(one_rank)
    runs = json.loads((out / "manifest.json").read_text())["runs"]
    assert runs[-1]["units_written"] == 1 and runs[-1]["units_already_written"] == 4
    with pytest.raises(UserError, match="other settings"):
        job.run(_cfg(chatty_target, inputs, out, "sampling.max_new_tokens=13"))


def test_a_refusal_names_the_settings_that_differ(chatty_target, inputs, one_rank, tmp_path):
    out = shutil.copytree(one_rank, tmp_path / "gen")
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(UserError) as caught:
        job.run(
            _cfg(chatty_target, inputs, out, "sampling.max_new_tokens=13", "generate.turns=last")
        )
    assert str(caught.value) == (
        f"output.dir {out} holds answers made with other settings: generate.turns "
        '("all" -> "last"), sampling.max_new_tokens (12 -> 13); choose a new output.dir, or rerun '
        "with the settings of its manifest.json."
    )
    manifest = json.loads((out / "manifest.json").read_text())  # as if another target had answered
    ours = manifest["settings"]["target"]["weights_sha256"]
    manifest["settings"]["target"]["weights_sha256"], manifest["key"] = "f" * 64, "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError) as caught:
        job.run(_cfg(chatty_target, inputs, out))
    says = f"other settings: the target's weights_sha256 (ffffffffffff -> {ours[:12]}); "
    assert says in str(caught.value)
    before["manifest.json"] = (out / "manifest.json").read_bytes()
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_dry_run_writes_nothing_and_a_directory_without_answers_is_taken_over(
    chatty_target, inputs, one_rank, tmp_path
):
    out = tmp_path / "gen"
    job.run(_cfg(chatty_target, inputs, out, "run.dry_run=true"))
    missing = inputs + [str(tmp_path / "missing.jsonl")]
    with pytest.raises(UserError, match="matches no file"):  # refused, nothing written
        job.run(_cfg(chatty_target, missing, out))
    assert not out.exists()
    out.mkdir()  # what a dry run used to leave: a manifest of its settings and no answers
    (out / ".units").mkdir()
    manifest = json.loads((one_rank / "manifest.json").read_text())
    old = {"key": manifest["key"], "settings": manifest["settings"], "runs": []}
    (out / "manifest.json").write_text(json.dumps(old))
    job.run(_cfg(chatty_target, inputs, out, "sampling.max_new_tokens=13"))  # taken over
    taken = json.loads((out / "manifest.json").read_text())
    assert taken["settings"]["sampling"]["max_new_tokens"] == 13 and taken["key"] != manifest["key"]
    assert len(_files(out)) == 5 and _files(out).keys().isdisjoint(_files(one_rank).keys())


def test_the_summary_counts_each_generated_token_once(one_rank):
    """The answers' tokens, as the shards hold them, and this run's tokens are one figure: the
    end-of-turn token that stops an answer is in neither."""
    manifest = json.loads((one_rank / "manifest.json").read_text())
    assert manifest["finish_reasons"].get("stop", 0) >= 3  # answers ended by an end-of-turn token
    assert manifest["counts"]["generated_tokens"] == manifest["runs"][0]["tokens_generated"] > 0


def test_prompts_moved_elsewhere_resume_their_output(chatty_target, inputs, one_rank, tmp_path):
    # unit names and records' "source" name the prompt files without their paths
    moved = [str(shutil.copy(p, tmp_path / Path(p).name)) for p in inputs]
    out = shutil.copytree(one_rank, tmp_path / "gen")
    (out / sorted(_files(out))[1]).unlink()
    job.run(_cfg(chatty_target, moved, out))
    assert _files(out) == _files(one_rank)
    assert json.loads((out / "manifest.json").read_text())["runs"][-1]["units_already_written"] == 4


def test_two_gloo_ranks_write_the_files_of_one(chatty_target, inputs, one_rank, tmp_path):
    out = tmp_path / "two"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "precompute.generate.cli",
        "--out",
        str(out),
        f"--target.path={chatty_target}",
        f"--data.inputs={json.dumps(inputs)}",
        "--target.dtype=fp32",
        "--run.device=cpu",
        "--run.samples_per_unit=2",
        "--generate.sort_window_units=1",
        "--sampling.max_new_tokens=12",
    ]
    done = subprocess.run(
        cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("plan:") == 1 and done.stdout.count("done:") == 1
    assert _files(out) == _files(one_rank)
    assert json.loads((out / "manifest.json").read_text())["runs"][0]["world_size"] == 2


def _greedy(model, prompt: list[int], max_new: int, stops: list[int]) -> list[int]:
    """transformers' own greedy answer to `prompt` (the stop token last where it stopped)."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=256,
    )
    return out[0, len(prompt) :].tolist()


def test_precompute_takes_each_last_answer_as_the_target_emitted_it(tiny_target, inputs, tmp_path):
    """A generated record keeps its last answer's tokens (`answer_ids`, the stop token last), and
    dflash-precompute's tokenizer builds the sequence from them: the prompt as generate fed it to
    the target, then those tokens. The reference, computed another way: transformers' greedy
    `model.generate` from that prompt. The tiny target's byte tokens spell no UTF-8 alone, so its
    answers' text, re-tokenised, is not its tokens: the text path would train on other tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_common.chat import ChatTemplate, prompt_ids
    from precompute.config import DataSection
    from precompute.inputs import RawRecord
    from precompute.tokenizing import UnitTokenizer

    target = tmp_path / "target"  # stops on a byte some answers emit: answers stop and are cut
    shutil.copytree(tiny_target, target)
    stops = [258, 110]
    gen = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": stops}))
    # turns = last: the input's earlier assistant turns stay in the prompts
    job.run(
        _cfg(target, inputs, tmp_path / "gen", "sampling.max_new_tokens=16", "generate.turns=last")
    )
    records = {r["source"]: r for r in _records(tmp_path / "gen").values()}
    assert {r["finish_reason"] for r in records.values()} == {"stop", "length"}
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    raws = [RawRecord(i, k, json.dumps(r).encode()) for i, (k, r) in enumerate(records.items())]
    unit = UnitTokenizer.from_target(str(target), DataSection(block_size=2))(0, raws)
    assert unit.num_samples >= 5 and unit.as_generated == unit.num_samples and not unit.ids_unused
    text_path, earlier, chat = 0, 0, ChatTemplate(tok)
    for n, key in enumerate(unit.sample_ids):
        r = records[key]
        ids = unit.input_ids[unit.offsets[n] : unit.offsets[n + 1]].tolist()
        mask = unit.loss_mask[unit.offsets[n] : unit.offsets[n + 1]].tolist()
        history, answer = r["messages"][:-1], r["answer_ids"]
        prompt = prompt_ids(tok, history)
        assert ids == prompt + answer and mask[len(prompt) :] == [1] * len(answer)
        ref = _greedy(model, prompt, 16, stops)
        assert answer == ref  # the stop token included, where the answer stopped
        assert (answer[-1] in stops) == (r["finish_reason"] == "stop")
        if any(m["role"] == "assistant" for m in history):  # masked as the text path masks it
            ids_h, mask_h = chat.tokenize(history[:-1])
            assert ids[: len(ids_h)] == ids_h.tolist() and mask[: len(mask_h)] == mask_h.tolist()
            assert sum(mask[: len(prompt)]) == sum(mask_h) > 0
            earlier += 1
        text_path += chat.tokenize(r["messages"])[0].tolist()[: len(ids)] != ids
    assert text_path > 0  # the test can fail: re-tokenised text is not what the target emitted
    assert earlier >= 1
    first = next(iter(records.values()))
    edited = dict(first, messages=first["messages"][:-1] + [assistant_message("an edit")])
    again = UnitTokenizer.from_target(str(target), DataSection(block_size=2))(
        0, [RawRecord(0, "e", json.dumps(edited).encode())]
    )
    assert (again.as_generated, again.ids_unused) == (0, 1)  # ids that do not spell it: the text
    assert again.input_ids.tolist() == chat.tokenize(edited["messages"])[0].tolist()


def test_an_earlier_answer_stays_in_the_loss_only_where_the_prompt_holds_it_as_emitted(
    tiny_target, tmp_path
):
    """turns = all: a record keeps the tokens of every earlier answer (`earlier_answer_ids`), each
    the target's greedy answer to its own prompt (the reference: transformers' `model.generate`).
    dflash-precompute keeps an earlier answer in the loss where the last turn's prompt holds exactly
    those tokens after that answer's own prompt, and takes it out (context only, counted) where it
    does not: the tiny target's bytes spell no UTF-8 alone, so their text, rendered again in the
    later prompt, is other tokens. Such an answer is then a sequence of its own (`<id>#<turn>`: its
    prompt, then its tokens) unless data.earlier_answers = 'context'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_common.chat import prompt_ids
    from precompute.config import DataSection
    from precompute.inputs import RawRecord
    from precompute.tokenizing import UnitTokenizer

    target = tmp_path / "target"  # stops on one byte in eight: most turns stop, a few tokens in
    shutil.copytree(tiny_target, target)
    stops = [258] + list(range(0, 256, 8))
    gen = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": stops}))
    write_jsonl(tmp_path / "in.jsonl", [_conv(i, 3) for i in range(12)])
    job.run(
        _cfg(target, [str(tmp_path / "in.jsonl")], tmp_path / "gen", "sampling.max_new_tokens=24")
    )
    records = {r["source"]: r for r in _records(tmp_path / "gen").values()}
    multi = {k: r for k, r in records.items() if "earlier_answer_ids" in r}
    assert len(multi) >= 3 and all(r["generated_turns"] > 1 for r in multi.values())
    assert all(r["generated_turns"] == 1 for k, r in records.items() if k not in multi)
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    turns = {
        k: [i for i, m in enumerate(r["messages"]) if m["role"] == "assistant"]
        for k, r in multi.items()
    }
    for k, r in multi.items():
        assert len(r["earlier_answer_ids"]) == len(turns[k]) - 1
        for i, emitted in zip(turns[k], r["earlier_answer_ids"]):
            prompt = prompt_ids(tok, r["messages"][:i])
            ref = _greedy(model, prompt, 24, stops)
            assert emitted == ref and emitted[-1] in stops  # it stopped: a next turn followed

    def tokenized(recs: dict[str, dict], earlier: str = "context"):
        raws = [RawRecord(i, k, json.dumps(r).encode()) for i, (k, r) in enumerate(recs.items())]
        data = DataSection(block_size=2, earlier_answers=earlier)
        return UnitTokenizer.from_target(str(target), data)(0, raws)

    # the reference, per record: which earlier answers the last prompt holds as emitted
    masked_turns, apart = {}, {}
    for key, r in multi.items():
        prompt = prompt_ids(tok, r["messages"][:-1])
        bounds = [len(prompt_ids(tok, r["messages"][:i])) for i in turns[key]]
        masked_turns[key] = []
        for j, emitted in enumerate(r["earlier_answer_ids"]):
            if prompt[bounds[j] : bounds[j] + len(emitted)] != emitted:
                masked_turns[key].append(j)
                if len(emitted) >= 4:  # 2 x block_size: long enough to train apart
                    apart[f"{key}#{turns[key][j]}"] = (bounds[j], emitted)
    unit = tokenized(multi)
    assert unit.num_samples >= 3 and unit.as_generated == unit.num_samples
    for n, key in enumerate(unit.sample_ids):
        r = multi[key]
        ids = unit.input_ids[unit.offsets[n] : unit.offsets[n + 1]].tolist()
        mask = unit.loss_mask[unit.offsets[n] : unit.offsets[n + 1]].tolist()
        prompt = prompt_ids(tok, r["messages"][:-1])
        assert ids == prompt + r["answer_ids"] and mask[len(prompt) :] == [1] * len(r["answer_ids"])
        bounds = [len(prompt_ids(tok, r["messages"][:i])) for i in turns[key]]
        for j, emitted in enumerate(r["earlier_answer_ids"]):
            start, end = bounds[j], bounds[j + 1]  # the answer, then the next user turn
            held = j not in masked_turns[key]
            assert sum(mask[start:end]) == (len(emitted) if held else 0)
    masked = sum(len(masked_turns[k]) for k in unit.sample_ids)
    assert masked > 0 and unit.earlier_masked == masked  # the test can fail: not all round-trip
    both = tokenized(multi, "apart")  # the default: each masked answer also a sequence of its own
    got = {k: n for n, k in enumerate(both.sample_ids)}
    assert apart and set(got) == set(unit.sample_ids) | set(apart)
    kept = {k.rsplit("#", 1)[0] for k in got}
    assert both.earlier_masked == sum(len(masked_turns[k]) for k in kept)
    assert both.earlier_apart == len(apart) and unit.earlier_apart == 0
    for key, (length, emitted) in apart.items():
        n, o = got[key], both.offsets
        ids, mask = both.input_ids[o[n] : o[n + 1]].tolist(), both.loss_mask[o[n] : o[n + 1]]
        record, turn = key.rsplit("#", 1)
        assert ids == prompt_ids(tok, multi[record]["messages"][: int(turn)]) + emitted
        assert len(ids) == length + len(emitted)
        assert mask.tolist() == [0] * length + [1] * len(emitted)
    # a record without them (written before they were kept): every earlier answer by its text
    before = tokenized({k: {**r, "earlier_answer_ids": None} for k, r in multi.items()})

    def samples(u) -> dict[str, tuple[list[int], int]]:
        o = u.offsets
        return {
            k: (u.input_ids[o[n] : o[n + 1]].tolist(), int(u.loss_mask[o[n] : o[n + 1]].sum()))
            for n, k in enumerate(u.sample_ids)
        }

    now, then = samples(unit), samples(before)
    assert before.earlier_masked == 0 and set(now) <= set(then)  # fewer trained tokens: skips
    assert all(now[k][0] == then[k][0] and now[k][1] <= then[k][1] for k in now)
    assert sum(then[k][1] for k in now) > sum(now[k][1] for k in now)


def test_cut_answers_are_kept_with_their_reason_or_dropped(tiny_target, inputs, tmp_path):
    keep = tmp_path / "keep"
    job.run(_cfg(tiny_target, inputs, keep, "sampling.max_new_tokens=4"))
    records = _records(keep)
    cut = {k for k, r in records.items() if r["finish_reason"] == "length"}
    assert len(cut) >= 5 and records["c0"]["finish_reason"] == "length"
    assert (
        records["c0"]["generated_turns"] == 1 and len(records["c0"]["messages"]) == 3
    )  # ends at the cut
    drop = tmp_path / "drop"
    job.run(_cfg(tiny_target, inputs, drop, "sampling.max_new_tokens=4", "generate.on_length=drop"))
    manifest = json.loads((drop / "manifest.json").read_text())
    assert manifest["skips"]["counts"]["cut_by_length"] == len(cut)
    assert _records(drop) == {k: r for k, r in records.items() if k not in cut}


def test_the_cli_prints_the_plan_and_the_summary_and_precompute_reads_the_output(
    chatty_target, inputs, tmp_path
):
    out = tmp_path / "cli"
    base = [
        "--out",
        str(out),
        f"--target.path={chatty_target}",
        f"--data.inputs={json.dumps(inputs)}",
        "--target.dtype=fp32",
        "--run.device=cpu",
        "--run.samples_per_unit=2",
        "--sampling.max_new_tokens=12",
    ]
    dry = subprocess.run(
        [sys.executable, "-m", "precompute.generate.cli", *base, "--dry-run"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert (
        "plan: 10 input records -> 5 work units (0 already in" in dry.stdout
        and "done:" not in dry.stdout
    )
    assert (
        "prompts to answer: 7; skipped 3 (blank_line 1, malformed_json 1, pre_tokenized 1)"
        in dry.stdout
    )
    assert "max tokens out: 96 (12 per turn, greedy" in dry.stdout
    assert not out.exists()  # a dry run writes nothing
    done = subprocess.run(
        [sys.executable, "-m", "precompute.generate.cli", *base],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "done: 7 conversations (8 turns" in done.stdout
        and "5 shards written, 0 already there" in done.stdout
    )
    import re

    in_shards = re.search(r"([\d,]+) generated tokens\) in 5 shards", done.stdout).group(1)
    assert f"; {in_shards} tokens generated at " in done.stdout  # one figure for one count
    assert [s.path for s in resolve_inputs([str(out)])] == [
        str(p) for p in sorted(out.glob("u*.jsonl"))
    ]
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "precompute.generate.cli",
            "--out",
            str(tmp_path / "x"),
            "--target.path=/nonexistent",
            '--data.inputs=["a"]',
        ],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        bad.returncode == 2 and bad.stderr.count("\n") == 1 and "has no config.json" in bad.stderr
    )
