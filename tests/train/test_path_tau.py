"""Path tau (train/path_tau.py) equals the emitted lengths of real greedy speculative decoding
(dflash-eval's `evaluate_drafter`, `Decoded.emitted`: each cycle cut at the response's end) on data
the target generated greedily, cycle for cycle, so path tau equals the report's `tau_emitted`; the
report's `tau` (the DFlash authors' uncut count) differs only in each response's last cycle.

The data: prompts of the demo set answered by the tiny target with the very greedy loop dflash-eval
uses as its baseline (`target_generate`, float32), some ended by a stop token, the others by the length
limit; hidden states by the real dflash-precompute in float32, stored in bf16; a drafter trained a
little by the real dflash-train, so it accepts drafts. The real decoding hands the drafter the target's
float32 features rounded to bf16 as the store holds them (`Bf16Context`): with that, every cycle of
every prompt matches. (Unrounded, near-tied draft argmaxes may differ: numerics, not the replay.)
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from train_helpers import ROOT, tiny_records

PROMPTS, MAX_NEW, BLOCK = 12, 40, 8

pytestmark = pytest.mark.usefixtures("one_thread")


class Bf16Context:
    """dflash-eval's proposer, handed the context features rounded to bf16 (what the store keeps)."""

    def __init__(self, proposer):
        self.proposer, self.block_size, self.layer_ids = proposer, proposer.block_size, proposer.layer_ids

    def begin(self, prompt_ids):
        self.proposer.begin(prompt_ids)

    def propose(self, context, anchor, start, num_drafts):
        return self.proposer.propose(context.bfloat16().float(), anchor, start, num_drafts)


def greedy_records(model, tokenizer) -> list[dict]:
    """Demo prompts answered by the target alone (dflash-eval's baseline loop and stop tokens), as
    token records."""
    from dflash_common.hf import stop_token_ids
    from train.eval.spec_decode import TargetRunner, target_generate

    runner, out, stops = TargetRunner(model, []), [], stop_token_ids(model.generation_config, tokenizer)
    for r in tiny_records(PROMPTS):
        prompt = [t for t, m in zip(r["input_ids"], r["loss_mask"]) if not m]
        answer = target_generate(runner, prompt, max_new_tokens=MAX_NEW, stop_ids=stops).tokens
        out.append({"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)})
    return out


@pytest.fixture(scope="module")
def greedy_setup(tiny_target, tmp_path_factory):
    """(target model with a stop token it emits, records, store, trained run dir)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_common.config import load_config
    from precompute.config import PrecomputeConfig
    from precompute.job import run as precompute
    from train.config import TrainConfig
    from train.loop import run as train

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    # a token the random target emits now and then stands for the end of turn: some answers stop early
    stop = tiny_records(1)[0]["input_ids"][-20]
    model.generation_config.eos_token_id = stop
    records = greedy_records(model, AutoTokenizer.from_pretrained(tiny_target))
    tmp = tmp_path_factory.mktemp("path-tau")
    data = tmp / "greedy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    store = precompute(load_config(PrecomputeConfig, None, [
        f"--target.path={tiny_target}", f"--data.inputs={json.dumps([str(data)])}", f"--store.path={tmp / 'store'}",
        "--target.dtype=fp32", "--store.dtype=bf16", "--data.block_size=2", "--data.max_length=512",
        "--run.samples_per_unit=4", "--run.device=cpu", "--run.progress=false"]))
    run = train(load_config(TrainConfig, ROOT / "configs" / "tiny.toml", [
        f"--data.stores={json.dumps([str(store)])}", f"--run.target={tiny_target}", f"--run.out_dir={tmp / 'run'}",
        f"--drafter.block_size={BLOCK}", "--data.holdout_sequences=4", "--optim.max_steps=60",
        "--validation.every_steps=30", "--checkpoint.every_steps=60", "--log.tensorboard=false",
        "--log.progress=false", "--objective.max_anchors=64"]))
    return model, records, store, run, stop


@pytest.mark.slow  # the module's fixture runs precompute and a short training run (~2.5 min on 2 cores)
def test_trainer_logs_path_tau_beside_the_estimate(greedy_setup):
    from train.metrics import read_metrics

    *_, run, _ = greedy_setup
    val = [r for r in read_metrics(run) if r["kind"] == "val"]
    assert [r["step"] for r in val] == [30, 60]
    assert all(1 <= r["path_tau"] <= BLOCK and r["path_cycles"] > 0 for r in val)
    assert (run / "report.png").is_file()


@pytest.mark.slow
def test_path_tau_equals_real_greedy_decoding_cycle_for_cycle(greedy_setup, tiny_target):
    from transformers import AutoTokenizer

    from dflash_common.config import load_config
    from dflash_common.drafter.export import load_drafter
    from train.eval.config import EvalConfig
    from train.eval.load import attach_target
    from train.eval.offline import path_tau_offline
    from train.eval.prompts import Prompt
    from train.eval.run import evaluate_drafter

    model, records, store, run, stop = greedy_setup
    ends = [r["input_ids"][-1] == stop for r in records]
    assert any(ends) and not all(ends), "the data must hold answers ended by the stop token and by the limit"
    drafter, _ = load_drafter(run / "drafter", dtype=torch.float32)
    proposer = attach_target(drafter, model)
    cfg = load_config(EvalConfig, None, [f"--target.path={tiny_target}", f"--generation.max_new_tokens={MAX_NEW}",
                                         "--generation.warmup=false", "--target.device=cpu"])
    prompts = [Prompt(f"p{i}", ids=[t for t, m in zip(r["input_ids"], r["loss_mask"]) if not m])
               for i, r in enumerate(records)]
    real = evaluate_drafter(model, AutoTokenizer.from_pretrained(tiny_target), Bf16Context(proposer), cfg, prompts)
    assert real["lossless"]["ok"]

    path = path_tau_offline(drafter, store, max_new_tokens=MAX_NEW, holdout_sequences=10**6, batch_tokens=4096)
    by_tail = {tuple(t): lengths for t, lengths in zip(path["path_prompt_tails"], path["path_lengths"])}
    replayed = [by_tail[tuple(p.ids[-16:])] for p in prompts]
    assert replayed == [e["emitted"] for e in real["prompts"]]
    assert max(max(x) for x in replayed) > 2, "the drafter must accept drafts for the test to mean anything"
    assert path["path_tau"] == pytest.approx(real["tau_emitted"], rel=1e-12, abs=0)
    cycles = [n for x in replayed for n in x]
    assert path["path_tau_pooled"] == pytest.approx(statistics.fmean(cycles), rel=1e-12)
    assert path["path_cycles"] == len(cycles) and path["path_sequences"] == PROMPTS
    # the authors' uncut count differs only in the last cycle: counted in full, or (anchored at the
    # response's last token, every token past the end) a cycle path tau cannot have
    cut, dropped = 0, 0
    for e in real["prompts"]:
        uncut, emitted = e["acceptance_lengths"], e["emitted"]
        assert emitted and len(uncut) - len(emitted) in (0, 1)
        assert uncut[:len(emitted) - 1] == emitted[:-1] and uncut[len(emitted) - 1] >= emitted[-1]
        assert 1 + sum(emitted) == e["new_tokens"] <= 1 + sum(uncut)  # emitted: exactly the output
        if len(uncut) == len(emitted):  # the last cycle cut, not dropped: the uncut tau is the larger
            assert e["tau"] >= statistics.fmean(emitted)
            cut += uncut[-1] > emitted[-1]
        dropped += len(uncut) > len(emitted)
    assert cut and dropped, "the data must hold last cycles cut at the end and last cycles past it"
    # A dropped cycle (anchored at the output's last token) counts 1 + accepted in tau; when that is below
    # the prompt's mean it pulls tau below tau_emitted, so over prompts the two may fall either way.
    assert real["num_cycles"] == path["path_cycles"] + dropped


def test_response_segments_split_turns_and_sequences():
    from train.path_tau import response_segments

    # seq 0: 0..4 ends inside a run; seq 1: 5..10
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1]).bool()
    cu = torch.tensor([0, 5, 11])
    first, end, start = response_segments(mask, cu, None)
    assert first.tolist() == [1, 4, 5, 10] and end.tolist() == [3, 5, 9, 11] and start.tolist() == [0, 0, 5, 5]
    first, end, _ = response_segments(mask, cu, 2)  # two new tokens at most, the prefill's included
    assert end.tolist() == [3, 5, 7, 11]


def test_the_last_cycle_counts_what_it_emits():
    from train.path_tau import cycle_length

    anchors, end = torch.tensor([10, 10, 10]), torch.tensor([30, 14, 12])
    # 5 accepted drafts: 6 tokens, unless the response ends first (its last token at end - 1)
    assert cycle_length(torch.tensor([5, 5, 0]), anchors, end).tolist() == [6, 3, 1]


def test_the_cut_rule_is_spec_decodes_emitted_rule():
    """cycle_length (the replay's end rule) and spec_decode's emitted_lengths (the real loop's) agree."""
    from train.path_tau import cycle_length
    from train.eval.spec_decode import emitted_lengths

    starts, uncut, end = [10, 14, 16, 20], [4, 2, 4, 3], 22  # the last anchor at 20: one token before 22
    cut = cycle_length(torch.tensor(uncut) - 1, torch.tensor(starts), torch.tensor(end)).tolist()
    assert emitted_lengths(starts, uncut, end) == cut == [4, 2, 4, 1]
    assert emitted_lengths(starts, uncut, 21) == [4, 2, 4]  # the anchor at 20 is the last token: dropped


@pytest.fixture(scope="module")
def dspark_run(greedy_setup, tiny_target):
    """A DSpark drafter (B = BLOCK - 1: the same verified block) trained a little on the same
    store."""
    from dflash_common.config import load_config
    from train.config import TrainConfig
    from train.loop import run as train

    _, _, store, run, _ = greedy_setup
    return train(
        load_config(
            TrainConfig,
            ROOT / "configs" / "tiny.toml",
            [
                f"--data.stores={json.dumps([str(store)])}",
                f"--run.target={tiny_target}",
                f"--run.out_dir={run.parent / 'dspark-run'}",
                "--drafter.arch=dspark",
                f"--drafter.block_size={BLOCK - 1}",
                "--drafter.markov_rank=16",
                "--data.holdout_sequences=4",
                "--optim.max_steps=60",
                "--validation.every_steps=60",
                "--checkpoint.every_steps=60",
                "--log.tensorboard=false",
                "--log.progress=false",
                "--objective.max_anchors=64",
            ],
        )
    )


@pytest.mark.slow
def test_dspark_path_tau_equals_real_greedy_decoding_cycle_for_cycle(
    greedy_setup, dspark_run, tiny_target
):
    """The replay drafts DSpark's blocks as dflash-eval does (B drafts, the Markov chain from the
    anchor)."""
    from transformers import AutoTokenizer

    from dflash_common.config import load_config
    from dflash_common.drafter.export import load_drafter
    from train.eval.config import EvalConfig
    from train.eval.load import attach_target
    from train.eval.offline import path_tau_offline
    from train.eval.prompts import Prompt
    from train.eval.run import evaluate_drafter

    model, records, store, _, _ = greedy_setup
    drafter, _ = load_drafter(dspark_run / "drafter", dtype=torch.float32)
    proposer = attach_target(drafter, model)
    assert proposer.block_size == BLOCK
    cfg = load_config(
        EvalConfig,
        None,
        [
            f"--target.path={tiny_target}",
            f"--generation.max_new_tokens={MAX_NEW}",
            "--generation.warmup=false",
            "--target.device=cpu",
        ],
    )
    prompts = [
        Prompt(f"p{i}", ids=[t for t, m in zip(r["input_ids"], r["loss_mask"]) if not m])
        for i, r in enumerate(records)
    ]
    real = evaluate_drafter(
        model, AutoTokenizer.from_pretrained(tiny_target), Bf16Context(proposer), cfg, prompts
    )
    assert real["lossless"]["ok"]
    path = path_tau_offline(
        drafter, store, max_new_tokens=MAX_NEW, holdout_sequences=10**6, batch_tokens=4096
    )
    by_tail = {
        tuple(t): lengths for t, lengths in zip(path["path_prompt_tails"], path["path_lengths"])
    }
    replayed = [by_tail[tuple(p.ids[-16:])] for p in prompts]
    assert replayed == [e["emitted"] for e in real["prompts"]]
    assert max(max(x) for x in replayed) > 2, (
        "the drafter must accept drafts for the test to mean anything"
    )
    assert path["path_tau"] == pytest.approx(real["tau_emitted"], rel=1e-12, abs=0)
