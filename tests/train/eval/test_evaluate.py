"""The speculative-decoding harness, proved with drafters whose acceptance lengths are known
exactly.

The oracle drafter knows the target's greedy continuation and proposes it (every draft accepted:
tau = B); the always-wrong drafter proposes a different token everywhere (tau = 1); the noisy oracle
corrupts drafts at fixed positions, so partial acceptances and cache crops of every length occur and
the expected acceptance lengths follow from the corrupted positions alone.
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_common.errors import UserError
from dflash_common.config import load_config
from train.eval.config import EvalConfig
from train.eval.prompts import Prompt, load_prompts
from train.eval.report import first_mismatch, format_report, lossless_message, write_report
from train.eval.run import PromptResult, Settings, decode_prompts, evaluate_drafter, summarize
from dflash_common.sampling import Sampling
from train.eval.spec_decode import (
    Decoded,
    TargetRunner,
    accept_sampled,
    speculative_generate,
    target_generate,
)

LAYER_IDS = [1, 2, 3, 4, 5]  # the DFlash default for the 8-layer tiny target
TEXTS = [
    "hello world, this is a test",
    "abc",
    "The quick brown fox",
    "0123456789",
    "spec decoding!",
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="module")
def runner(tiny):
    return TargetRunner(tiny[0], LAYER_IDS)


@pytest.fixture(scope="module")
def prompts(tiny):
    tok = tiny[1]
    return [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            )
        )
        for t in TEXTS
    ]


class OracleDrafter:
    """Proposes the target's greedy continuation, known beforehand; `corrupt(position)` marks
    positions whose draft is replaced by another token. Checks what the engine hands it and records
    the context."""

    def __init__(
        self,
        continuations: dict[tuple, list[int]],
        block_size: int,
        vocab_size: int,
        layer_ids: Sequence[int] = LAYER_IDS,
        corrupt: Callable[[int], bool] = lambda pos: False,
        check_anchor: bool = True,
    ):
        self.continuations = continuations
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.layer_ids = list(layer_ids)
        self.corrupt = corrupt
        self.check_anchor = (
            check_anchor  # off when sampling: the committed tokens are not the greedy ones
        )
        self.seq: list[int] = []
        self.seen = 0
        self.contexts: list[torch.Tensor] = []

    def begin(self, prompt_ids):
        self.seq = list(prompt_ids) + self.continuations[tuple(prompt_ids)]
        self.seen, self.contexts = 0, []

    def propose(self, context, anchor, start, num_drafts):
        assert context.shape[0] == start - self.seen, (
            "the engine must hand over exactly the new context"
        )
        assert not self.check_anchor or self.seq[start] == anchor, (
            "the anchor must be the committed token at `start`"
        )
        self.contexts.append(context.clone())
        self.seen = start
        out = []
        for pos in range(start + 1, start + 1 + num_drafts):
            token = self.seq[pos] if pos < len(self.seq) else 0
            out.append((token + 1) % self.vocab_size if self.corrupt(pos) else token)
        return torch.tensor(out)


def greedy_continuations(runner, prompts, n, stop_ids=frozenset(), beyond: int = 16):
    """The target's greedy continuations, `beyond` tokens longer than decoded: the authors' loop
    drafts whole blocks past the length limit, and an oracle knows those tokens too."""
    return {
        tuple(p): target_generate(runner, p, max_new_tokens=n + beyond, stop_ids=stop_ids).tokens
        for p in prompts
    }


def expected_lengths(
    prompt_len: int, max_new: int, block: int, corrupt: Callable[[int], bool]
) -> list[int]:
    """Acceptance lengths implied by the corrupted positions alone (no stop tokens), by the DFlash
    authors' loop (z-lab/dflash `spec_generate`): whole blocks while the anchor is below the limit,
    each cycle counted uncut."""
    lengths, start, max_len = [], prompt_len, prompt_len + max_new
    while start < max_len:
        drafts = range(start + 1, start + block)
        accepted = next((k for k, pos in enumerate(drafts) if corrupt(pos)), len(drafts))
        lengths.append(accepted + 1)
        start += accepted + 1
    return lengths


def test_target_alone_matches_hf_generate(tiny, runner, prompts):
    model, tok = tiny
    for p in prompts[:3]:
        ours = target_generate(runner, p, max_new_tokens=24).tokens
        ref = model.generate(
            torch.tensor([p]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id,
        )[0, len(p) :].tolist()
        assert ours == ref


@pytest.mark.parametrize("block", [4, 7])
def test_oracle_drafter_gets_tau_equal_block_size(tiny, runner, prompts, block):
    m = 4
    max_new = (
        m * block
    )  # the prefill's token, then m whole cycles, the last one past the limit by 1
    oracle = OracleDrafter(
        greedy_continuations(runner, prompts, max_new), block, tiny[0].config.vocab_size
    )
    for p in prompts:
        out = speculative_generate(runner, oracle, p, block_size=block, max_new_tokens=max_new)
        assert out.acceptance_lengths == [block] * m
        assert out.tokens == oracle.continuations[tuple(p)][:max_new]


def test_context_features_are_the_layer_outputs_at_committed_positions(tiny, runner, prompts):
    """What the drafter is handed equals hidden_states[i + 1] of one full forward, position by
    position."""
    model = tiny[0]
    p, block, max_new = prompts[0], 4, 30
    oracle = OracleDrafter(
        greedy_continuations(runner, [p], max_new),
        block,
        model.config.vocab_size,
        corrupt=lambda pos: pos % 3 == 0,
    )
    out = speculative_generate(runner, oracle, p, block_size=block, max_new_tokens=max_new)
    handed = torch.cat(oracle.contexts)  # [start of the last cycle, K*H]
    with torch.inference_mode():
        states = model(torch.tensor([p + out.tokens]), output_hidden_states=True).hidden_states
    full = torch.cat([states[i + 1][0] for i in LAYER_IDS], dim=-1)[: handed.shape[0]]
    assert handed.shape == (oracle.seen, len(LAYER_IDS) * model.config.hidden_size)
    torch.testing.assert_close(handed, full, atol=2e-5, rtol=1e-4)
    assert not torch.equal(full[:, :64], full[:, 64:128]), "layer ids must select different layers"


def test_always_wrong_drafter_gets_tau_one_and_stays_lossless(tiny, runner, prompts):
    max_new, block = 20, 5
    wrong = OracleDrafter(
        greedy_continuations(runner, prompts, max_new),
        block,
        tiny[0].config.vocab_size,
        layer_ids=[],
        corrupt=lambda pos: True,
    )
    for p in prompts:
        out = speculative_generate(runner, wrong, p, block_size=block, max_new_tokens=max_new)
        assert out.acceptance_lengths == [1] * max_new  # the last cycle's token lies past the limit
        assert out.tokens == wrong.continuations[tuple(p)][:max_new]


def test_noisy_drafter_accepts_partially_and_stays_lossless(tiny, runner, prompts):
    def corrupt(pos):  # deterministic, irregular gaps: acceptance lengths of many sizes
        return (pos * 7919) % 13 < 3

    block, max_new = 6, 45
    noisy = OracleDrafter(
        greedy_continuations(runner, prompts, max_new),
        block,
        tiny[0].config.vocab_size,
        corrupt=corrupt,
    )
    seen = set()
    for p in prompts:
        out = speculative_generate(runner, noisy, p, block_size=block, max_new_tokens=max_new)
        assert out.tokens == target_generate(runner, p, max_new_tokens=max_new).tokens
        assert out.acceptance_lengths == expected_lengths(len(p), max_new, block, corrupt)
        assert len(out.tokens) == max_new and 1 + sum(out.acceptance_lengths) >= max_new
        seen.update(out.acceptance_lengths)
    assert len(seen) >= 3, (
        f"the test should exercise several acceptance lengths, saw {sorted(seen)}"
    )


@pytest.mark.parametrize("remainder", [0, 1, 2, 4])
def test_the_last_cycle_drafts_a_whole_block_and_counts_uncut(tiny, runner, prompts, remainder):
    """As the authors' loop: a whole block while the anchor is below the limit (`start <
    max_length`), its acceptance counted in full even where the output is then cut at the limit."""
    block, m = 5, 3
    max_new = 1 + m * block + remainder
    oracle = OracleDrafter(
        greedy_continuations(runner, prompts[:2], max_new), block, tiny[0].config.vocab_size
    )
    for p in prompts[:2]:
        out = speculative_generate(runner, oracle, p, block_size=block, max_new_tokens=max_new)
        assert out.acceptance_lengths == [block] * (
            m + 1
        )  # the anchor at P + m*block < max_len still drafts
        assert out.tokens == oracle.continuations[tuple(p)][:max_new]
        # emitted: what lands in the cut output; with no remainder the last anchor is the last token
        assert out.emitted == [block] * m + ([remainder] if remainder else [])
        assert 1 + sum(out.emitted) == len(out.tokens)


def _first_new_token_index(tokens: list[int], lowest: int) -> int:
    return next(j for j in range(lowest, len(tokens)) if tokens[j] not in tokens[:j])


@pytest.mark.parametrize("lowest", [0, 3, 9, 13])
def test_stop_token_cuts_the_last_cycle_which_still_counts(tiny, runner, prompts, lowest):
    block, max_new = 4, 40
    p = prompts[2]
    free = greedy_continuations(runner, [p], max_new)[tuple(p)]
    j = _first_new_token_index(free, lowest)  # the stop token first appears at new-token index j
    stop = frozenset([free[j]])
    oracle = OracleDrafter({tuple(p): free}, block, tiny[0].config.vocab_size)
    out = speculative_generate(
        runner, oracle, p, block_size=block, max_new_tokens=max_new, stop_ids=stop
    )
    # the authors' loop stops after the cycle whose output holds the stop token, counted uncut; a
    # prefill token that is one (j = 0) still gets its cycle
    cycles = 1 if j == 0 else (j - 1) // block + 1
    assert out.acceptance_lengths == [block] * cycles
    last = j - (cycles - 1) * block  # the last cycle's tokens up to the stop token; none when j = 0
    assert out.emitted == [block] * (cycles - 1) + ([last] if last else [])
    assert 1 + sum(out.emitted) == len(out.tokens)
    assert out.tokens == free[: j + 1]
    assert out.tokens == target_generate(runner, p, max_new_tokens=max_new, stop_ids=stop).tokens


def test_sampling_with_top_k_one_is_greedy_and_the_oracle_is_fully_accepted(tiny, runner, prompts):
    block, max_new = 4, 13
    oracle = OracleDrafter(
        greedy_continuations(runner, prompts, max_new), block, tiny[0].config.vocab_size
    )
    point = Sampling(
        temperature=1.0, top_k=1
    )  # a point mass on the argmax: accept/resample = greedy
    for i, p in enumerate(prompts):
        g = torch.Generator().manual_seed(i)
        out = speculative_generate(
            runner, oracle, p, block_size=block, max_new_tokens=max_new, sampling=point, generator=g
        )
        assert out.tokens == oracle.continuations[tuple(p)][:max_new]
        assert out.acceptance_lengths == [block] * 4  # anchors at 0, 4, 8, 12 < 13


def test_sampled_decoding_is_seeded_and_tau_in_range(tiny, runner, prompts):
    block, max_new = 4, 30
    oracle = OracleDrafter(
        greedy_continuations(runner, prompts[:1], max_new),
        block,
        tiny[0].config.vocab_size,
        check_anchor=False,
    )
    hot = Sampling(temperature=0.8, top_p=0.95)

    def run(seed):
        return speculative_generate(
            runner,
            oracle,
            prompts[0],
            block_size=block,
            max_new_tokens=max_new,
            sampling=hot,
            generator=torch.Generator().manual_seed(seed),
        )

    a, b = run(7), run(7)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
    assert all(1 <= n <= block for n in a.acceptance_lengths)
    assert len(a.tokens) == max_new and 1 + sum(a.acceptance_lengths) >= max_new


def test_accept_rule_with_a_greedy_draft_emits_the_target_distribution():
    """Accept x with probability p(x), else sample p without x: the emitted token is distributed as
    p."""
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
    g = torch.Generator().manual_seed(0)
    trials = 10000  # standard error <= 0.005: the 0.02 tolerance is 4 sigma
    for draft in (0, 3):
        counts, accepted_count = torch.zeros(5), 0
        for _ in range(trials):
            accepted, token = accept_sampled(torch.tensor([draft]), p, g)
            first = draft if accepted else token
            counts[first] += 1
            accepted_count += accepted
            assert accepted or token != draft, "a rejected draft is never resampled"
        torch.testing.assert_close(counts / trials, p[0], atol=0.02, rtol=0)
        assert abs(accepted_count / trials - float(p[0, draft])) < 0.02


def test_accept_rule_with_a_drawn_draft_emits_the_target_distribution():
    """Drafts drawn from q (generation.draft_sampling = 'probabilistic'): accept x with probability
    min(1, p(x)/q(x)), else draw from max(p - q, 0): the emitted token is distributed as p, and a
    draft is accepted with probability sum_x min(p(x), q(x))."""
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3]])
    g = torch.Generator().manual_seed(0)
    trials = 10000  # standard error <= 0.005: the 0.02 tolerance is 4 sigma
    counts, accepted_count = torch.zeros(5), 0
    for _ in range(trials):
        draft = torch.multinomial(q[0], 1, generator=g)
        accepted, token = accept_sampled(draft, p, g, q)
        counts[int(draft) if accepted else token] += 1
        accepted_count += accepted
    torch.testing.assert_close(counts / trials, p[0], atol=0.02, rtol=0)
    assert abs(accepted_count / trials - float(torch.minimum(p[0], q[0]).sum())) < 0.02


def test_drawn_drafts_against_a_point_mass_target_decode_greedily(
    tiny, drafter_dir, prompts, monkeypatch
):
    """Drafts drawn from an untrained DFlash drafter at temperature 1 (nearly every one not the
    argmax), verified by a target whose top_k = 1 makes p a point mass on its argmax: a draft is
    kept only where it is that argmax and a rejection draws the argmax, so the output is greedy
    decoding's, token for token."""
    from train.eval.load import load_proposer

    model = tiny[0]
    proposer = load_proposer(str(drafter_dir), model)
    drawn, sampled = [], proposer.drafter.sampled_drafts

    def counted(*args):
        drafts, q = sampled(*args)
        drawn.append((drafts, q))
        return drafts, q

    monkeypatch.setattr(proposer.drafter, "sampled_drafts", counted)
    target = TargetRunner(model, proposer.layer_ids)
    point, max_new = Sampling(temperature=1.0, top_k=1), 24
    for i, p in enumerate(prompts):
        out = speculative_generate(
            target,
            proposer,
            p,
            block_size=proposer.block_size,
            max_new_tokens=max_new,
            sampling=point,
            generator=torch.Generator().manual_seed(i),
            draft_sampling="probabilistic",
        )
        assert out.tokens == target_generate(target, p, max_new_tokens=max_new).tokens
    assert len(drawn) >= len(prompts)  # every cycle drew its drafts
    for drafts, q in drawn:  # distributions over the vocabulary, each draft inside its own
        torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[:-1]))
        assert bool((q.gather(-1, drafts[..., None]) > 0).all())
    argmax = sum(int((d == q.argmax(-1)).sum()) for d, q in drawn)
    assert argmax < sum(d.numel() for d, _ in drawn) // 2  # drawn, not the argmax


def test_probabilistic_drafts_need_a_sampling_target():
    with pytest.raises(Exception, match="generation.temperature > 0"):
        load_config(EvalConfig, None, ["--generation.draft_sampling=probabilistic"])
    cfg = load_config(
        EvalConfig,
        None,
        ["--generation.draft_sampling=probabilistic", "--generation.temperature=0.7"],
    )
    assert cfg.generation.draft_sampling == "probabilistic"


def _result(name, lengths, mismatch=None, prompt_tokens=10, emitted=None):
    spec = Decoded(
        [1] * (1 + sum(lengths)),
        list(lengths),
        0.0,
        0.5,
        list(lengths if emitted is None else emitted),
    )
    target = Decoded([1] * (1 + sum(lengths)), [], 0.0, 1.0)
    return PromptResult(name, prompt_tokens, spec, target, mismatch)


def _settings(block=4, greedy=True):
    sampling = Sampling(0.0 if greedy else 1.0, max_new_tokens=64)
    return Settings(block, sampling, frozenset(), True, greedy)


def test_tau_is_the_mean_over_prompts_of_the_per_prompt_mean():
    results = [_result("a", [4, 4, 1]), _result("b", [2]), _result("c", [])]
    report = summarize(results, _settings())
    assert report["tau"] == pytest.approx((3 + 2) / 2)  # not the pooled 11/4
    assert report["tau_pooled"] == pytest.approx(11 / 4)  # 1 + accepted / drafts, as engines log it
    assert report["tau_emitted"] == report["tau"]  # no cycle was cut
    assert report["num_prompts_without_cycles"] == 1
    assert report["histogram_counts"] == {"1": 1, "2": 1, "3": 0, "4": 2}
    assert sum(report["histogram"].values()) == pytest.approx(1)
    assert report["speedup"] == pytest.approx(2.0)  # target 1.0 s vs speculative 0.5 s per prompt
    assert report["lossless"]["ok"] is True
    assert "tau (acceptance length)" in format_report(report)


def test_tau_emitted_counts_the_cycles_cut_as_the_output_is():
    results = [
        _result("a", [4, 4, 4], emitted=[4, 4, 1]),  # the last cycle cut at the limit
        _result("b", [2, 3], emitted=[2]),  # the last anchor was the output's last token
        _result("c", [5], emitted=[]),
    ]  # a stop token from the prefill: a cycle, nothing emitted
    report = summarize(results, _settings(block=5))
    assert report["tau"] == pytest.approx((4 + 2.5 + 5) / 3)  # the authors' uncut count
    assert report["tau_emitted"] == pytest.approx((3 + 2) / 2)
    assert (
        report["prompts"][0]["emitted"] == [4, 4, 1] and "tau_emitted" in report["tau_definition"]
    )
    assert "cycles cut at the end" in format_report(report)


def test_lossless_failure_names_prompt_and_position():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2
    report = summarize(
        [_result("ok.jsonl:1", [2]), _result("bad.jsonl:7", [3], mismatch=2, prompt_tokens=12)],
        _settings(),
    )
    message = lossless_message(report)
    assert "bad.jsonl:7" in message and "new token 2" in message and "position 14" in message
    assert report["lossless"]["ok"] is False and "FAILED" in format_report(report)


def test_prompt_files_of_every_kind(tiny, tmp_path):
    tok = tiny[1]
    path = tmp_path / "p.jsonl"
    lines = [
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "dropped"},
            ]
        },
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "hi"},
            ]
        },
        {"prompt": "raw text"},
        {"turns": ["one", "two"]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    got = load_prompts([str(path)], tok, {})
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert got[0].ids == tok.encode(chat) and chat.endswith("<|im_start|>assistant\n")
    assert tok.decode(got[1].ids).startswith("<|im_start|>system\nbe brief")
    assert got[2].ids == tok.encode("raw text")
    assert got[3].turns == ["one", "two"] and got[3].name == f"{path}:4"
    assert len(load_prompts([str(path)], tok, {}, limit=2)) == 2


def test_a_prompts_tools_reach_the_template_as_in_generate(tiny, tmp_path):
    """A prompt record's `tools` are rendered as dflash-generate renders them (a template that
    prints them; without them it prints nothing)."""
    import copy

    tok = copy.deepcopy(tiny[1])
    tok.chat_template = (
        "{% if tools %}TOOLS {{ tools | length }}\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": tools}))
    (got,) = load_prompts([str(path)], tok, {})
    assert tok.decode(got.ids) == "TOOLS 1\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("not json", ":2 is not valid JSON"),
        ('{"text": "x"}', ":2: found none of"),
        (
            '{"conversations": [{"from": "bot", "value": "x"}]}',
            r"role 'bot' \(known: system, .*human",
        ),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "no message before its reply"),
        ('{"messages": [{"role": "user"}]}', r"needs a string 'content' \(missing_field\); fix"),
        ('{"conversations": [{"from": "human", "content": "x"}]}', "turn 0 needs a string 'value'"),
        ('{"messages": [{"role": "wizard", "content": "x"}]}', "turn 0 has role 'wizard'"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_prompt_lines_name_file_and_line(tiny, tmp_path, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(UserError, match=fragment):
        load_prompts([str(path)], tiny[1], {})
    with pytest.raises(UserError, match="does not exist"):
        load_prompts([str(tmp_path / "missing.jsonl")], tiny[1], {})


def test_evaluate_drafter_end_to_end_with_multi_turn_prompts(tiny, runner, prompts, tmp_path):
    model, tok = tiny
    block = 4
    cfg = load_config(
        EvalConfig, None, ["--generation.max_new_tokens=9", "--generation.ignore_eos=true"]
    )
    items = [Prompt("a.jsonl:1", ids=prompts[0]), Prompt("a.jsonl:2", turns=["first", "second"])]
    turn_ids = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": "first"}], tokenize=False, add_generation_prompt=True
            )
        )
    ]
    continuations = greedy_continuations(runner, [prompts[0]] + turn_ids, 9)
    oracle = OracleDrafter(continuations, block, model.config.vocab_size)
    oracle.begin = _learning_begin(
        oracle, runner
    )  # the second turn's prompt is known only at run time
    report = evaluate_drafter(model, tok, oracle, cfg, items)
    assert [x["name"] for x in report["prompts"]] == [
        "a.jsonl:1",
        "a.jsonl:2#turn1",
        "a.jsonl:2#turn2",
    ]
    assert report["tau"] == block and report["lossless"]["ok"] is True
    assert report["num_cycles"] == 3 * 3 and report["new_tokens"] == 3 * 9  # anchors at 0, 4, 8 < 9
    out = tmp_path / "r" / "eval.json"
    write_report(report, str(out), cfg)
    saved = json.loads(out.read_text())
    assert saved["tau"] == block and saved["run"]["config"]["generation"]["max_new_tokens"] == 9
    assert (out.parent / "eval.run.toml").is_file()


def _learning_begin(oracle: OracleDrafter, runner: TargetRunner):
    """Extend the oracle to prompts it was not given: compute their greedy continuation on first
    sight."""
    original = oracle.begin

    def begin(prompt_ids):
        key = tuple(prompt_ids)
        if key not in oracle.continuations:
            oracle.continuations[key] = target_generate(
                runner, prompt_ids, max_new_tokens=9 + 16
            ).tokens
        original(prompt_ids)

    return begin


def test_decode_prompts_warm_up_does_not_change_results(tiny, runner, prompts):
    block = 4
    oracle = OracleDrafter(
        greedy_continuations(runner, prompts[:2], 9), block, tiny[0].config.vocab_size
    )
    s = Settings(block, Sampling(max_new_tokens=9), frozenset(), True, True)
    items = [Prompt(str(i), ids=p) for i, p in enumerate(prompts[:2])]
    cold = decode_prompts(runner, oracle, items, s, warmup=False)
    warm = decode_prompts(runner, oracle, items, s, warmup=True)
    assert [r.spec.tokens for r in cold] == [r.spec.tokens for r in warm]
    assert all(r.first_mismatch is None for r in warm)


@pytest.mark.parametrize("name", ["tiny.toml", "eval-qwen3-8b.toml"])
def test_shipped_eval_configs_load(name):
    from pathlib import Path

    cfg = load_config(EvalConfig, Path(__file__).resolve().parents[3] / "configs" / name)
    assert cfg.target.path and cfg.prompts.files and cfg.report.path.endswith(".json")
    if name == "tiny.toml":
        assert cfg.target.dtype == "float32" and cfg.check.lossless == "error"
    else:
        assert cfg.target.dtype == "bfloat16" and cfg.prompts.chat_template_kwargs == {
            "enable_thinking": False
        }


def test_eval_config_refuses_a_lossless_check_without_its_reference():
    from dflash_common.config import ConfigError

    with pytest.raises(ConfigError, match="check.lossless needs check.baseline"):
        load_config(EvalConfig, None, ["--check.baseline=false"])
    assert (
        load_config(
            EvalConfig, None, ["--check.baseline=false", "--check.lossless=off"]
        ).check.baseline
        is False
    )
    with pytest.raises(ConfigError, match="generation.block_size"):
        load_config(EvalConfig, None, ["--generation.block_size=1"])


def test_baseline_cache_decodes_the_target_alone_once_and_keys_on_the_target(
    tiny, runner, prompts, tiny_target, tmp_path, monkeypatch
):
    """--check.baseline_cache: a second evaluation reads the target-alone decodes back (same report,
    no target-alone decoding), a cached reference that differs is still caught by the lossless
    check, and another target (other weight bytes) misses."""
    import shutil

    import train.eval.run as evaluate_module

    model, tok = tiny
    block, cache = 4, tmp_path / "baseline"
    cfg = load_config(
        EvalConfig,
        None,
        [
            "--generation.max_new_tokens=9",
            f"--target.path={tiny_target}",
            f"--check.baseline_cache={cache}",
            "--generation.warmup=false",
        ],
    )
    items = [Prompt(str(i), ids=p) for i, p in enumerate(prompts[:3])]
    oracle = OracleDrafter(
        greedy_continuations(runner, prompts[:3], 9),
        block,
        model.config.vocab_size,
        corrupt=lambda pos: pos % 3 == 0,
    )
    first = evaluate_drafter(model, tok, oracle, cfg, items)
    entries = sorted(cache.glob("*.json"))
    assert len(entries) == 3 and first["lossless"]["ok"] is True

    def no_target_alone(*args, **kwargs):
        raise AssertionError("the target alone was decoded again")

    monkeypatch.setattr(evaluate_module, "target_generate", no_target_alone)
    second = evaluate_drafter(model, tok, oracle, cfg, items)
    for key in ("tau", "tau_pooled", "num_cycles", "target_tokens_per_s", "lossless"):
        assert second[key] == first[key], key

    entry = json.loads(
        entries[0].read_text()
    )  # a reference that differs from the speculative output
    entry["tokens"][3] = (entry["tokens"][3] + 1) % model.config.vocab_size
    entries[0].write_text(json.dumps(entry))
    assert evaluate_drafter(model, tok, oracle, cfg, items)["lossless"]["ok"] is False

    other = tmp_path / "other-target"
    shutil.copytree(tiny_target, other)
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor: another checkpoint, same config
    weights.write_bytes(bytes(data))
    monkeypatch.undo()
    cfg_other = load_config(
        EvalConfig,
        None,
        [
            "--generation.max_new_tokens=9",
            f"--target.path={other}",
            f"--check.baseline_cache={cache}",
            "--generation.warmup=false",
        ],
    )
    evaluate_drafter(model, tok, oracle, cfg_other, items)
    assert (
        len(list(cache.glob("*.json"))) == 6
    )  # three more entries: nothing of the first target was reused
