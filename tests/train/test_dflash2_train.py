"""dflash-train with --drafter.arch=dflash2 end to end on the tiny target's real stores: exact
resume, fp8 states, two ranks, the served walk's figures in validation and the offline estimate,
then export, the lint, and dflash-eval decoding the export losslessly with the drafts the training
forward's walk predicts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import train.loop as loop
from dflash_common.drafter import serving
from dflash_common.drafter.export import export, load_drafter
from dflash_common.drafter.record import read_drafter_config
from dflash_common.errors import UserError
from dflash_common.drafter.target_head import load_target_head
from train_helpers import train_args
from train.checkpoint import complete_checkpoints
from train.cli import main, parse
from train.eval.load import load_proposer
from train.eval.offline import evaluate_offline
from train.eval.spec_decode import TargetRunner, speculative_generate, target_generate
from train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
DFLASH2 = ["--drafter.arch=dflash2", "--drafter.selector_rank=16", "--drafter.selector_top_k=4"]


def _args(store, target, out, *extra):
    return train_args(store, target, out, *DFLASH2, *extra)


def _curve(run_dir):
    keys = (
        "kind",
        "step",
        "loss",
        "acc",
        "tau",
        "grad_norm",
        "tau_unary",
        "top_k_recall",
        "selector_loss",
    )
    return [tuple(json.dumps(r.get(k)) for k in keys) for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def trained(tiny_store, tiny_target, tmp_path_factory):
    """An uninterrupted DFlash2 run (8 steps, validation at 4 and 8, 'strict' candidates so the
    objective's other branch runs here too) and the same run stopped after step 3 and resumed."""
    work = tmp_path_factory.mktemp("dflash2")
    extra = [
        "--optim.max_steps=8",
        "--validation.every_steps=4",
        "--checkpoint.every_steps=100",
        "--objective.selector_candidates=strict",
    ]
    loop.run(parse(_args(tiny_store, tiny_target, work / "straight", *extra)))
    real_step, calls = loop.train_step, []

    def step_then_sigterm(*a, **k):
        info = real_step(*a, **k)
        calls.append(1)
        if len(calls) == 3:
            os.kill(
                os.getpid(), signal.SIGTERM
            )  # the real handler: save at this step boundary, leave
        return info

    loop.train_step = step_then_sigterm
    try:
        loop.run(parse(_args(tiny_store, tiny_target, work / "stopped", *extra)))
    finally:
        loop.train_step = real_step
    assert [s for s, _ in complete_checkpoints(work / "stopped")] == [3]
    loop.run(
        parse(_args(tiny_store, tiny_target, work / "stopped", *extra))
    )  # the same command resumes
    return work


def test_a_stopped_and_resumed_run_repeats_the_uninterrupted_one_bit_for_bit(trained):
    straight = _curve(trained / "straight")
    assert len(straight) == 8 + 2 and _curve(trained / "stopped") == straight
    a = load_file(trained / "straight" / "step-8" / "drafter" / "model.safetensors")
    b = load_file(trained / "stopped" / "step-8" / "drafter" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (
        "candidate_selector.successor_codebook" in a
        and a["candidate_selector.successor_codebook"].abs().sum() > 0
    )
    assert not torch.equal(
        a["layers.0.mlp_conv.kernel_projection.weight"],
        torch.zeros_like(a["layers.0.mlp_conv.kernel_projection.weight"]),
    )  # the convs learn


def test_validation_reports_the_walk_and_the_offline_estimate_agrees(
    trained, tiny_store, tiny_target
):
    val = [r for r in read_metrics(trained / "stopped") if r["kind"] == "val"][-1]
    assert 0 < val["top_k_recall"] <= 1 and val["tau_unary"] >= 1 and val["selector_loss"] > 0
    assert 1 <= val["tau"] <= 4 and val["path_tau"] >= 1
    drafter, _ = load_drafter(trained / "stopped" / "step-8")
    head = load_target_head(tiny_target)
    drafter.attach_frozen(head.embed, head.lm_head)
    offline = evaluate_offline(
        drafter, tiny_store, max_anchors=8, holdout_sequences=4, batch_tokens=1024, autocast="none"
    )
    for key in ("loss", "acc", "tau", "tau_unary", "top_k_recall", "selector_loss", "path_tau"):
        assert offline[key] == pytest.approx(val[key], rel=1e-6), key


def test_the_export_lints_clean_and_dflash_eval_decodes_it_losslessly(
    trained, tiny_target, tmp_path
):
    out = export(trained / "stopped", tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert serving.errors(serving.lint_drafter_dir(out)) == []
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target)
    proposer = load_proposer(str(out), model)
    runner = TargetRunner(model, proposer.layer_ids)
    for text in ("Tell me about bees.", "abc"):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = tok.encode(ids)
        spec = speculative_generate(runner, proposer, ids, block_size=4, max_new_tokens=30)
        assert (
            spec.tokens == target_generate(runner, ids, max_new_tokens=30).tokens
        )  # lossless, float32
        assert all(1 <= n <= 4 for n in spec.acceptance_lengths)
    config = json.loads((out / "config.json").read_text())  # a hand edit of the selector's top-k
    config["dflash_config"]["selector_top_k"] = 3
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UserError, match="`dflash_config.selector_top_k` = 3 where .* trained with 4"
    ):
        read_drafter_config(out)


def test_the_proposer_drafts_the_walk_of_the_training_forward(trained, tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    proposer = load_proposer(str(trained / "stopped"), model)
    drafter = proposer.drafter
    tok = AutoTokenizer.from_pretrained(tiny_target)
    ids = tok.encode("Explain tides to a child.")
    seq = ids + target_generate(TargetRunner(model, []), ids, max_new_tokens=12).tokens
    with torch.inference_mode():
        states = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    feats = torch.cat([states[i + 1][0] for i in proposer.layer_ids], dim=-1)
    first, second = len(ids), len(ids) + 5
    proposer.begin(ids)
    proposer.propose(feats[:first], seq[first], first, 3)
    drafts = proposer.propose(feats[first:second], seq[second], second, 3)
    with torch.inference_mode():
        cu = torch.tensor([0, len(seq)])
        hidden = drafter(feats, torch.tensor(seq), cu, torch.tensor([second]))  # [1, B, H]
        expected = drafter.greedy_drafts(hidden, torch.tensor([seq[second]]))[0]
    assert drafts.tolist() == expected.tolist()


def test_an_fp8_store_trains_a_dflash2_drafter(tiny_store_fp8, tiny_target, tmp_path):
    main(
        _args(
            tiny_store_fp8,
            tiny_target,
            tmp_path / "fp8",
            "--optim.max_steps=2",
            "--data.gpu_prefetch=0",
        )
    )
    train = [r for r in read_metrics(tmp_path / "fp8") if r["kind"] == "train"]
    assert len(train) == 2 and all(0 < r["loss"] < 40 for r in train)


def test_resuming_a_dflash_run_as_dflash2_is_refused_in_one_sentence(
    tiny_store, tiny_target, tmp_path, capsys
):
    args = _args(tiny_store, tiny_target, tmp_path / "run", "--optim.max_steps=1")
    dflash = [a for a in args if a not in DFLASH2]
    main(dflash)
    with pytest.raises(SystemExit) as e:
        main(_args(tiny_store, tiny_target, tmp_path / "run", "--optim.max_steps=2"))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "cannot resume" in err and "dflash2" in err, err
    with pytest.raises(SystemExit) as e:
        main(_args(tiny_store, tiny_target, tmp_path / "other", "--drafter.conv_group_size=24"))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "conv_group_size = 24 must divide hidden_size = 64" in err, err


def test_two_ranks_average_the_selectors_gradients_too(
    tiny_store, tiny_target, tmp_path, one_thread
):
    """The selector's parameters are used outside the wrapped forward (in the loss): under torchrun
    (gloo), each rank one batch, DDP's gradients are still those of one process over both."""
    from grad_helpers import accumulate, setup

    out = tmp_path / "grads.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "tests" / "train" / "grad_helpers.py"),
        str(tiny_store),
        str(tiny_target),
        str(out),
        *DFLASH2,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = torch.load(out, weights_only=True)
    cfg, drafter, batches = setup(tiny_store, tiny_target, grad_accum=2, extra=tuple(DFLASH2))
    want = accumulate(drafter, drafter, cfg, batches)
    assert ddp.keys() == want.keys() and "candidate_selector.successor_codebook" in want
    for name in want:
        torch.testing.assert_close(ddp[name], want[name], rtol=1e-4, atol=1e-7, msg=name)


def test_soft_targets_train_a_dflash2_drafter(tiny_store_final, tiny_target, tmp_path):
    """The soft loss hands over no top-k: the selector's candidates come from a pass of their
    own."""
    main(
        _args(
            tiny_store_final,
            tiny_target,
            tmp_path / "kl",
            "--optim.max_steps=2",
            "--targets.soft=kl",
            "--validation.every_steps=2",
        )
    )
    val = [r for r in read_metrics(tmp_path / "kl") if r["kind"] == "val"][-1]
    assert 0 < val["top_k_recall"] <= 1 and val["selector_loss"] > 0
