"""dflash-train with a DSpark drafter (--drafter.arch=dspark): its objective against a reference
computed the plain way (a Python loop over the block rows, the Markov bias and the logits
materialised, autograd), and the trainer end to end on the tiny stores: the loss falls, validation
reports tau over B drafts, stop and resume repeat the losses bit for bit, two ranks under torchrun,
an fp8 store, the options it refuses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import train.loop as loop
from dflash_common.config import ConfigError, load_config
from dflash_common.drafter.arch import config_class, new_drafter
from dflash_common.drafter.objective import AcceptanceCounts, default_gamma, dpace_weights
from dflash_common.drafter.target_head import load_target_head
from dflash_common.store import Store
from train_helpers import train_args
from train.checkpoint import complete_checkpoints
from train.cli import parse
from train.config import TrainConfig
from train.data import TrainData
from train.metrics import read_metrics
from train.objective import batch_objective
from train.validate import evaluate_batches

ROOT = Path(__file__).resolve().parents[2]
BLOCK, RANK = 4, 8


def _cfg(store, *overrides) -> TrainConfig:
    base = [
        "--data.cache_gb=0.01",
        "--data.batch_tokens=512",
        "--data.window_shards=2",
        "--data.holdout_sequences=4",
        f"--drafter.block_size={BLOCK}",
        "--drafter.arch=dspark",
        f"--drafter.markov_rank={RANK}",
        "--objective.max_anchors=8",
        "--precision.autocast=none",
    ]
    return load_config(TrainConfig, None, [f'--data.stores=["{store}"]', *base, *overrides])


@pytest.fixture(scope="module")
def head(tiny_target):
    return load_target_head(tiny_target, dtype=torch.float32)


def _drafter(tiny_target, head, with_markov=True):
    from transformers import AutoConfig

    dcfg = config_class("dspark").from_target(
        AutoConfig.from_pretrained(tiny_target),
        depth=1,
        block_size=BLOCK,
        layer_ids=[1, 3],
        mask_token_id=0,
        markov_rank=RANK,
        confidence_head_with_markov=with_markov,
    )
    torch.manual_seed(0)
    drafter = new_drafter(dcfg)
    with torch.no_grad():  # a Markov head and a confidence head that matter
        for p in (
            drafter.markov_head.markov_w1.weight,
            drafter.markov_head.markov_w2.weight,
            drafter.confidence_head.proj.weight,
        ):
            p.normal_(0.0, 1.0)
    drafter.attach_frozen(head.embed, head.lm_head)
    return drafter


CASES = [
    ("gamma", "none", "match", True, True),
    ("dpace", "none", "match", False, False),
    ("dpace", "dspark", "tv", False, True),
]


@pytest.mark.parametrize("weights,soft,label,detach,with_markov", CASES)
def test_objective_and_gradients_equal_a_reference(
    tiny_store_final, tiny_target, head, weights, soft, label, detach, with_markov
):
    store = Store.open(tiny_store_final)
    cfg = _cfg(
        tiny_store_final,
        f"--objective.weights={weights}",
        f"--targets.soft={soft}",
        f"--objective.confidence_label={label}",
        f"--objective.confidence_detach={str(detach).lower()}",
        "--objective.confidence_weight=0.7",
    )
    data = TrainData.build(
        cfg, [store], [1, 3], rank=0, world=1, device=torch.device("cpu"), block_size=BLOCK + 1
    )
    batch = next(data.start())
    drafter = _drafter(tiny_target, head, with_markov)
    found: dict = {}
    loss, norm, counts = batch_objective(
        drafter,
        drafter,
        batch,
        block_size=BLOCK,
        gamma=None,
        autocast="none",
        weights=weights,
        targets=cfg.targets,
        objective=cfg.objective,
        extras=found,
    )
    loss.backward()
    got = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    want, want_norm, correct, valid = _reference(drafter, batch, weights, soft, label, detach, 0.7)
    want.backward()
    ce_sum, rows = found["ce"].tolist()  # the Markov-corrected CE of every labelled row alike
    with torch.no_grad():
        plain = _reference(drafter, batch, "gamma", "none", "match", detach, 0.0, unit=True)[0]
    assert rows == valid.sum().item()
    torch.testing.assert_close(ce_sum / rows, plain.item() / rows, rtol=1e-5, atol=1e-5)
    val = evaluate_batches(drafter, [batch], block_size=BLOCK + 1, autocast="none", path=False)
    torch.testing.assert_close(val["ce"], ce_sum / rows, rtol=1e-6, atol=1e-6)  # held out alike
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(norm, want_norm, rtol=1e-5, atol=1e-5)
    c = AcceptanceCounts.from_tensor(counts)
    assert c.correct.tolist() == [0.0, *(correct & valid).sum(0).double().tolist()]
    assert c.valid.tolist() == [0.0, *valid.sum(0).double().tolist()]
    assert c.accepted == float((correct & valid).long().cumprod(1).sum())
    for name, p in drafter.named_parameters():
        torch.testing.assert_close(
            got[name], p.grad, rtol=1e-3, atol=1e-5, msg=f"gradient of {name}"
        )
        assert p.grad.abs().sum() > 0, name
    data.close()
    store.close()


def _reference(
    drafter, batch, weights_kind, soft, label, detach, conf_weight, alpha=0.5, unit=False
):
    """Row j of the block at a predicts the token at a+j+1 from lm_head(h_j) + W2 W1[token at a+j];
    everything materialised, one (anchor, row) at a time. `unit`: every valid row weighs 1."""
    b = BLOCK
    hidden = drafter(batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors)  # [A, B, H]
    ids, t = batch.input_ids, batch.tokens
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    head = drafter.lm_head_weight
    a_n = batch.anchors.shape[0]
    valid = torch.zeros(a_n, b, dtype=torch.bool)
    labels = torch.zeros(a_n, b, dtype=torch.long)
    for i, a in enumerate(batch.anchors.tolist()):
        end = int(
            batch.cu_seqlens[torch.searchsorted(batch.cu_seqlens, torch.tensor(a), right=True)]
        )
        for j in range(b):
            p = a + j + 1
            if p < end and batch.loss_mask[p]:
                valid[i, j], labels[i, j] = True, int(ids[p])
    prev = ids[
        (batch.anchors[:, None] + torch.arange(b)).clamp(max=t - 1)
    ]  # the true token at a + j
    embed = w1[prev]  # [A, B, r]
    logits = hidden @ head.T + embed @ w2.T  # [A, B, V]
    ce = (
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(a_n, b)
        * valid
    )
    per_row, tv = ce, None
    if soft != "none":
        teacher = (
            batch.final.float()[(batch.anchors[:, None] + torch.arange(b)).clamp(max=t - 1)]
            @ head.T
        )
        p_d, p_t = logits.softmax(-1), teacher.softmax(-1)
        l1 = (p_d - p_t).abs().sum(-1)
        per_row, tv = 0.1 * ce + 0.9 * l1, 0.5 * l1
    if weights_kind == "dpace":
        w = dpace_weights(ce.detach(), valid, alpha)
    else:
        w = torch.exp(-torch.arange(b).float() / default_gamma(b + 1)) * valid
    if unit:
        w = valid.float()
    correct = (logits.argmax(-1) == labels) & valid
    conf_in = torch.cat([hidden, embed], -1) if drafter.confidence_head.with_markov else hidden
    if detach:
        conf_in = conf_in.detach()
    proj = drafter.confidence_head.proj
    logit = (conf_in @ proj.weight.T + proj.bias).squeeze(-1)
    target = correct.float() if label == "match" else (1 - tv.detach()).clamp(0, 1)
    bce = F.binary_cross_entropy_with_logits(logit, target, reduction="none")
    loss = (w * per_row * valid).sum() + conf_weight * (w * bce).sum()
    return loss, w.sum(), correct, valid


# ---------------------------------------------------------------- the trainer end to end


def _args(store, target, out, *extra):
    dspark = ["--drafter.arch=dspark", f"--drafter.markov_rank={RANK}"]
    return train_args(store, target, out, *dspark, *extra, block_size=BLOCK)


def _curve(run_dir):
    keys = ("kind", "step", "epoch", "loss", "acc", "acc_by_pos", "tau", "lr", "grad_norm")
    return [tuple(json.dumps(r.get(k)) for k in keys) for r in read_metrics(run_dir)]


def test_trains_validates_and_resumes_bit_for_bit(tiny_store, tiny_target, tmp_path, monkeypatch):
    extra = [
        "--optim.max_steps=8",
        "--optim.grad_accum=2",
        "--validation.every_steps=4",
        "--checkpoint.every_steps=100",
    ]
    loop.run(parse(_args(tiny_store, tiny_target, tmp_path / "straight", *extra)))
    real_step, calls = loop.train_step, []

    def step_then_sigterm(*a, **k):
        info = real_step(*a, **k)
        calls.append(info.epoch)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return info

    monkeypatch.setattr(loop, "train_step", step_then_sigterm)
    stopped = tmp_path / "stopped"
    loop.run(parse(_args(tiny_store, tiny_target, stopped, *extra)))
    assert [s for s, _ in complete_checkpoints(stopped)] == [3]
    monkeypatch.setattr(loop, "train_step", real_step)
    loop.run(parse(_args(tiny_store, tiny_target, stopped, *extra)))
    assert _curve(stopped) == _curve(tmp_path / "straight")
    a = load_file(tmp_path / "straight" / "step-8" / "drafter" / "model.safetensors")
    b = load_file(stopped / "step-8" / "drafter" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {"markov_head.markov_w1.weight", "confidence_head.proj.bias"} <= set(a)
    records = read_metrics(stopped)
    val = [r for r in records if r["kind"] == "val"]
    assert len(val) == 2 and all(
        len(r["acc_by_pos"]) == BLOCK and 1.0 <= r["tau"] <= BLOCK + 1 for r in val
    )
    assert all(np.isfinite(r["path_tau"]) for r in val)
    config = json.loads((stopped / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == RANK


def test_the_loss_falls(tiny_store, tiny_target, tmp_path):
    loop.run(
        parse(
            _args(
                tiny_store,
                tiny_target,
                tmp_path / "run",
                "--optim.max_steps=30",
                "--validation.every_steps=0",
                "--checkpoint.every_steps=100",
            )
        )
    )
    train = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    first, last = np.mean([r["loss"] for r in train[:3]]), np.mean([r["loss"] for r in train[-3:]])
    assert last < 0.8 * first, (first, last)
    assert train[-1]["acc"] > train[0]["acc"]


def test_an_fp8_store_and_a_resume_into_another_arch(tiny_store_fp8, tiny_target, tmp_path):
    from train.cli import main

    main(_args(tiny_store_fp8, tiny_target, tmp_path / "fp8", "--optim.max_steps=2"))
    train = [r for r in read_metrics(tmp_path / "fp8") if r["kind"] == "train"]
    assert len(train) == 2 and all(0 < r["loss"] < 40 for r in train)
    with pytest.raises(
        SystemExit
    ) as e:  # the run directory holds a DSpark drafter: a DFlash run refuses it
        main(
            _args(
                tiny_store_fp8,
                tiny_target,
                tmp_path / "fp8",
                "--optim.max_steps=3",
                "--drafter.arch=dflash",
            )
        )
    assert e.value.code == 2


def test_two_ranks_under_torchrun_with_gloo(tiny_store, tiny_target, tmp_path):
    """The Markov and confidence heads are used outside DDP's forward: their gradients still
    reduce."""
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "train.cli",
        *_args(
            tiny_store,
            tiny_target,
            out,
            "--optim.max_steps=3",
            "--data.window_shards=1",
            "--run.device=cpu",
            "--checkpoint.every_steps=100",
        ),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    train = [r for r in read_metrics(out) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(r["loss"] > 0 for r in train)


@pytest.mark.parametrize(
    "option,match",
    [
        ("--objective.path_weight=1", "path_weight"),
        ("--targets.prompt_anchors=true", "prompt_anchors"),
        ("--objective.confidence_label=tv", "confidence_label"),
    ],
)
def test_what_dspark_refuses_is_one_sentence(tiny_store, option, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tiny_store, option)
