"""dflash-eval with a DSpark drafter trained by dflash-train (--drafter.arch=dspark) and exported: B
drafts a cycle drafted left to right through the Markov head, lossless in float32, every cycle
accepting exactly the leading run of what the training forward's Markov chain predicts at its
anchor, tau in [1, B+1] both ways, the confidence schedule as an option, and the offline
estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eval_helpers import batched_decodes_as_one_at_a_time
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_common.drafter.export import export
from train.eval.cli import main
from train.eval.load import load_proposer
from train.eval.prompts import load_prompts
from train.eval.spec_decode import TargetRunner, speculative_generate, target_generate


ROOT = Path(__file__).resolve().parents[3]
BLOCK, RANK = 4, 16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dspark_dir(tiny_store, tiny_target, tmp_path_factory):
    """A DSpark drafter trained 60 steps by dflash-train on the tiny store, exported in float32."""
    import train.loop as loop
    from train.cli import parse

    tmp = tmp_path_factory.mktemp("dspark-eval")
    loop.run(
        parse(
            [
                "--config",
                str(ROOT / "configs" / "tiny.toml"),
                "--store",
                str(tiny_store),
                "--out",
                str(tmp / "run"),
                f"--run.target={tiny_target}",
                "--drafter.arch=dspark",
                f"--drafter.block_size={BLOCK}",
                f"--drafter.markov_rank={RANK}",
                "--data.holdout_sequences=4",
                "--data.batch_tokens=1024",
                "--optim.max_steps=60",
                "--objective.max_anchors=32",
                "--validation.every_steps=0",
                "--log.progress=false",
                "--log.tensorboard=false",
            ]
        )
    )
    return export(tmp / "run", tmp / "export", dtype=torch.float32)


def _prompts(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    return load_prompts([str(ROOT / "data" / "tiny-prompts.jsonl")], tok, {})


def test_every_cycle_is_lossless_and_accepts_what_the_training_forward_predicts(
    model, dspark_dir, tiny_target
):
    """No training/serving mismatch: each cycle's acceptance length is 1 + the leading run of the
    Markov chain's greedy drafts over the training forward's rows at that cycle's anchor."""
    proposer = load_proposer(str(dspark_dir), model)
    assert proposer.block_size == BLOCK + 1  # the verified block: the anchor and B drafts
    target = TargetRunner(model, proposer.layer_ids)
    max_new, seen = 40, []
    for prompt in _prompts(tiny_target):
        out = speculative_generate(
            target, proposer, prompt.ids, block_size=proposer.block_size, max_new_tokens=max_new
        )
        assert out.tokens == target_generate(target, prompt.ids, max_new_tokens=max_new).tokens
        assert all(1 <= n <= BLOCK + 1 for n in out.acceptance_lengths)
        seq, max_len = prompt.ids + out.tokens, len(prompt.ids) + max_new
        anchors = (
            len(prompt.ids) + torch.tensor([0] + out.acceptance_lengths[:-1]).cumsum(0)
        ).tolist()
        drafter = proposer.drafter
        with torch.inference_mode():
            states = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
            feats = torch.cat([states[i + 1][0] for i in proposer.layer_ids], -1)
            cu = torch.tensor([0, len(seq)], dtype=torch.int32)
            hidden = drafter(feats, torch.tensor(seq), cu, torch.tensor(anchors))  # [cycles, B, H]
            predicted = drafter.greedy_drafts(hidden, torch.tensor(seq)[anchors])  # [cycles, B]
        for a, n, row in zip(anchors, out.acceptance_lengths, predicted.tolist()):
            if (
                a + BLOCK + 1 > max_len
            ):  # drafts past the output's end: nothing here to compare them with
                continue
            run = next((k for k in range(BLOCK) if row[k] != seq[a + 1 + k]), BLOCK)
            assert n == run + 1, f"{prompt.name}: cycle at {a}"
            seen.append(n)
    assert max(seen) >= 3, "the drafter must accept drafts for the test to mean anything"


def test_cli_reports_tau_both_ways_and_a_confidence_schedule_verifies_fewer(
    tiny_target, dspark_dir, tmp_path
):
    reports = {}
    for name, extra in (("all", []), ("schedule", ["--generation.confidence_threshold=0.5"])):
        report = tmp_path / f"{name}.json"
        main(
            [
                "--config",
                str(ROOT / "configs" / "tiny.toml"),
                "--drafter",
                str(dspark_dir),
                "--report",
                str(report),
                f"--target.path={tiny_target}",
                f"--prompts.files={ROOT / 'data' / 'tiny-prompts.jsonl'}",
                "--prompts.num_prompts=4",
                "--generation.max_new_tokens=24",
                "--generation.warmup=false",
                *extra,
            ]
        )
        reports[name] = json.loads(report.read_text())
    every, schedule = reports["all"], reports["schedule"]
    for out in (every, schedule):
        assert out["lossless"] == {"checked": True, "ok": True, "mismatches": []}
        assert out["block_size"] == BLOCK + 1 and 1 <= out["tau_pooled"] <= out["block_size"]
        assert 1 <= out["tau"] <= BLOCK + 1 and set(out["histogram"]) == {
            str(n) for n in range(1, BLOCK + 2)
        }
    # fewer drafts verified a cycle under the schedule: more cycles for the same tokens
    assert (
        schedule["num_cycles"] > every["num_cycles"]
        and schedule["new_tokens"] == every["new_tokens"]
    )


def test_a_block_size_override_counts_its_drafts(tiny_target, dspark_dir, tmp_path):
    report = tmp_path / "eval.json"
    main(
        [
            "--config",
            str(ROOT / "configs" / "tiny.toml"),
            "--drafter",
            str(dspark_dir),
            "--report",
            str(report),
            f"--target.path={tiny_target}",
            "--generation.block_size=2",
            "--prompts.num_prompts=1",
            f"--prompts.files={ROOT / 'data' / 'tiny-prompts.jsonl'}",
            "--generation.max_new_tokens=12",
            "--generation.warmup=false",
        ]
    )
    out = json.loads(report.read_text())
    assert out["block_size"] == 3 and all(n <= 3 for n in out["prompts"][0]["acceptance_lengths"])


def test_offline_estimate_and_path_tau(tiny_target, dspark_dir, tiny_store, tmp_path):
    report = tmp_path / "offline.json"
    main(
        [
            "--offline",
            "--store",
            str(tiny_store),
            "--drafter",
            str(dspark_dir),
            f"--target.path={tiny_target}",
            "--offline.holdout_sequences=4",
            "--target.device=cpu",
            "--report",
            str(report),
        ]
    )
    out = json.loads(report.read_text())
    assert len(out["acc_by_pos"]) == BLOCK and 1 <= out["tau"] <= BLOCK + 1
    assert 1 <= out["path_tau"] <= BLOCK + 1 and out["path_cycles"] > 0


def test_a_confidence_threshold_without_a_head_is_one_sentence(tiny_target, drafter_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main(
            [
                "--config",
                str(ROOT / "configs" / "tiny.toml"),
                "--drafter",
                str(drafter_dir),
                f"--target.path={tiny_target}",
                "--generation.confidence_threshold=0.5",
            ]
        )
    assert e.value.code == 2 and "confidence head" in capsys.readouterr().err


def test_batched_decoding_has_the_one_at_a_time_cycles(model, dspark_dir, tiny_target):
    """float32: through the batched loop (train/eval/batched.py) every prompt's tokens and cycles
    (accepted lengths, cycle for cycle) are the one-at-a-time loop's, the Markov head drafting
    each row's B drafts left to right in both, and the output is the target's own."""
    from train.eval import batched

    proposer = load_proposer(str(dspark_dir), model)
    assert batched.batchable(proposer)
    prompts = [p.ids for p in _prompts(tiny_target)]
    single = batched_decodes_as_one_at_a_time(model, proposer, prompts, proposer.block_size)
    seen = [n for a in single for n in a.acceptance_lengths]
    assert max(seen) >= 3, "the drafter must accept drafts for the test to mean anything"


def test_a_confidence_schedule_decodes_batched_with_the_one_at_a_time_cycles(
    model, dspark_dir, tiny_target
):
    """float32: under the schedule each row verifies a number of drafts of its own; the batched
    loop counts none past them (UNVERIFIED) and gives every prompt the one-at-a-time loop's tokens
    and cycles, which the schedule makes more and shorter than without it. `confident_prefix` of a
    batch is that of each of its rows."""
    from dflash_common.config import load_config
    from dflash_common.drafter.dspark import confident_prefix
    from train.eval import batched
    from train.eval.config import EvalConfig
    from train.eval.load import attach_target
    from train.eval.run import resolve_batch_size

    scheduled = attach_target(load_proposer(str(dspark_dir), model).drafter, model, None, 0.5)
    assert batched.batchable(scheduled)
    explicit = load_config(EvalConfig, None, ["--generation.batch_size=4"]).generation
    assert resolve_batch_size(explicit, model, scheduled, torch.device("cpu")) == 4
    prompts = [p.ids for p in _prompts(tiny_target)]
    block = scheduled.block_size
    single = batched_decodes_as_one_at_a_time(model, scheduled, prompts, block)
    target, every = TargetRunner(model, scheduled.layer_ids), load_proposer(str(dspark_dir), model)
    full = [
        speculative_generate(target, every, ids, block_size=block, max_new_tokens=40)
        for ids in prompts
    ]
    cycles = {
        "schedule": sum(len(a.acceptance_lengths) for a in single),
        "every": sum(len(f.acceptance_lengths) for f in full),
    }
    assert cycles["schedule"] > cycles["every"], cycles  # the schedule cut some blocks short
    conf = torch.tensor([[0.9, 0.8, 0.3, 0.95], [0.1, 0.9, 0.9, 0.9], [0.6, 0.6, 0.6, 0.6]])
    counts = confident_prefix(conf, 0.5)
    assert counts.tolist() == [2, 0, 4] == [int(confident_prefix(r, 0.5)) for r in conf]


def test_drafts_drawn_through_the_markov_head_are_draws_from_its_corrected_logits(
    model, dspark_dir, tiny_target
):
    """generation.draft_sampling = 'probabilistic': each draft is drawn, left to right, from
    softmax((logits + the Markov bias of the draft drawn before it) / T). The reference computes
    every row's distribution at once, the drawn drafts as the previous tokens (teacher forcing);
    an argmax 'draw' gives the greedy drafts; and a decode against a point-mass target (top_k 1)
    is greedy decoding's output."""
    from dflash_common.sampling import Sampling
    from train.eval.spec_decode import draw_from

    proposer = load_proposer(str(dspark_dir), model)
    drafter = proposer.drafter
    prompt = _prompts(tiny_target)[0].ids
    seq = (
        prompt
        + target_generate(TargetRunner(model, proposer.layer_ids), prompt, max_new_tokens=24).tokens
    )
    anchors = torch.tensor([len(prompt), len(prompt) + 5, len(prompt) + 11])
    with torch.inference_mode():
        states = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        feats = torch.cat([states[i + 1][0] for i in proposer.layer_ids], -1)
        cu = torch.tensor([0, len(seq)], dtype=torch.int32)
        hidden = drafter(feats, torch.tensor(seq), cu, anchors)  # [3, B, H]
        first = torch.tensor(seq)[anchors]
        greedy, drawn = drafter.greedy_drafts(hidden, first), 0
        for temperature in (8.0, 1.0, 0.6):  # 8: flat enough that draws leave the argmax
            g = torch.Generator().manual_seed(3)
            drafts, q = drafter.sampled_drafts(hidden, first, draw_from(Sampling(temperature), g))
            prev = torch.cat([first[:, None], drafts[:, :-1]], 1)  # [3, B]
            bias = drafter.markov_head.bias(drafter.markov_embed(prev))
            ref = torch.softmax((drafter.logits(hidden) + bias).float() / temperature, -1)
            torch.testing.assert_close(q, ref, atol=1e-5, rtol=1e-4)
            drawn += int((drafts != greedy).sum())
        assert drawn > 0  # the draws are not the argmax: the reference's previous tokens differ

        def argmax(logits):
            return logits.argmax(-1), torch.nn.functional.one_hot(
                logits.argmax(-1), logits.shape[-1]
            )

        top, _ = drafter.sampled_drafts(hidden, first, argmax)
        assert torch.equal(top, drafter.greedy_drafts(hidden, first))
    target = TargetRunner(model, proposer.layer_ids)
    out = speculative_generate(
        target,
        proposer,
        prompt,
        block_size=proposer.block_size,
        max_new_tokens=24,
        sampling=Sampling(temperature=1.0, top_k=1),
        generator=torch.Generator().manual_seed(0),
        draft_sampling="probabilistic",
    )
    assert out.tokens == seq[len(prompt) :]
