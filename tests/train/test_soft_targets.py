"""Soft targets and prompt anchors in the trainer: final states reach the device batch aligned with
the tokens (the target's greedy prediction from the state at p - 1 is the stored token at p, since
the tiny data are the tiny target's own greedy responses), labels and teacher rows of a block, prompt
anchors, the objective against a materialised reference, a short run, and the missing-state error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train.loop as loop
from dflash_common.errors import UserError
from dflash_common.config import load_config
from dflash_common.drafter.config import DrafterConfig
from dflash_common.drafter.loss import TARGET_ARGMAX, greedy_prompt_labels, teacher_rows
from dflash_common.drafter.model import DFlashDrafter
from dflash_common.drafter.objective import IGNORE_INDEX, block_labels, default_gamma
from dflash_common.drafter.target_head import load_target_head
from dflash_common.store import Store
from train.config import TrainConfig
from train.data import TrainData
from train.metrics import read_metrics
from train.objective import batch_objective

BLOCK = 4


def _cfg(store, *overrides):
    base = ["--data.cache_gb=0.01", "--data.batch_tokens=512", "--data.window_shards=2", "--data.holdout_sequences=4",
            f"--drafter.block_size={BLOCK}", "--objective.max_anchors=8", "--precision.autocast=none",
            "--objective.weights=gamma"]  # the references below use the gamma weights unless told
    return load_config(TrainConfig, None, [f"--data.stores=[\"{store}\"]", *base, *overrides])


@pytest.fixture(scope="module")
def head(tiny_target):
    return load_target_head(tiny_target, dtype=torch.float32)


def test_final_states_arrive_aligned_with_the_tokens(tiny_store_final, head):
    store = Store.open(tiny_store_final)
    data = TrainData.build(_cfg(tiny_store_final, "--targets.soft=kl"), [store], [1, 3], rank=0, world=1,
                           device=torch.device("cpu"))
    batch = next(data.start())
    assert batch.final.shape == (batch.tokens, 64) and batch.features.shape == (batch.tokens, 2 * 64)
    greedy = (batch.final.float() @ head.lm_head.T).argmax(-1)  # [T]: the target's next token
    starts = torch.zeros(batch.tokens, dtype=torch.bool)
    starts[batch.cu_seqlens[:-1]] = True
    response = batch.loss_mask & ~starts  # p is a response token whose state p - 1 is in its sequence
    predicted = greedy[:-1][response[1:]]
    assert response.sum() > 100 and (predicted == batch.input_ids[1:][response[1:]]).float().mean() > 0.97
    data.close()
    store.close()


def test_block_labels_teacher_rows_and_prompt_labels():
    ids = torch.arange(100, 112)
    # prompt, response, prompt, response
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1]).bool()
    cu = torch.tensor([0, 12])
    anchors = torch.tensor([1, 4])
    labels, weights = block_labels(ids, torch.ones_like(mask), cu, anchors, BLOCK)
    labels = greedy_prompt_labels(labels, mask, anchors)
    assert labels.tolist() == [[IGNORE_INDEX, TARGET_ARGMAX, 103, 104], [IGNORE_INDEX, 105, TARGET_ARGMAX, TARGET_ARGMAX]]
    assert teacher_rows(anchors, BLOCK).tolist() == [[0, 1, 2, 3], [3, 4, 5, 6]]  # a + k - 1
    assert (weights[:, 1:] > 0).all()


def test_prompt_anchors_sit_on_prompt_tokens_too(tiny_store_final):
    store = Store.open(tiny_store_final)
    counts = {}
    for prompt in (False, True):
        cfg = _cfg(tiny_store_final, f"--targets.prompt_anchors={str(prompt).lower()}", "--objective.max_anchors=64")
        data = TrainData.build(cfg, [store], [1], rank=0, world=1, device=torch.device("cpu"))
        batch = next(data.start())
        counts[prompt] = int((~batch.loss_mask[batch.anchors]).sum())
        data.close()
    assert counts[False] == 0 and counts[True] > 0
    store.close()


@pytest.mark.parametrize("soft,prompt,weights", [("kl", False, "gamma"), ("dspark", True, "gamma"),
                                                 ("none", True, "gamma"), ("tv", False, "dpace"),
                                                 ("none", True, "dpace")])
def test_objective_equals_a_reference_on_materialised_logits(tiny_store_final, tiny_target, head, soft, prompt,
                                                             weights):
    store = Store.open(tiny_store_final)
    cfg = _cfg(tiny_store_final, f"--targets.soft={soft}", f"--targets.prompt_anchors={str(prompt).lower()}",
               f"--objective.weights={weights}")
    data = TrainData.build(cfg, [store], [1, 3], rank=0, world=1, device=torch.device("cpu"))
    batch = next(data.start())
    torch.manual_seed(0)
    dcfg = DrafterConfig.from_target(store_target_config(tiny_target), depth=1, block_size=BLOCK, layer_ids=[1, 3],
                                     mask_token_id=0)
    drafter = DFlashDrafter(dcfg)
    drafter.attach_frozen(head.embed, head.lm_head)
    loss, weight, _ = batch_objective(drafter, drafter, batch, block_size=BLOCK, gamma=None, autocast="none",
                                      targets=cfg.targets, weights=weights)
    with torch.no_grad():
        hidden = drafter(batch.features, batch.input_ids, batch.cu_seqlens, batch.anchors).flatten(0, 1)
    want, want_weight = _reference(hidden, head.lm_head, batch, soft, prompt, weights)
    torch.testing.assert_close(loss.detach(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(weight.detach(), want_weight, rtol=1e-4, atol=1e-4)
    data.close()
    store.close()


def store_target_config(tiny_target):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_target)


def _reference(hidden, lm_head, batch, soft, prompt, weights_kind="gamma", alpha=0.5):
    """The objective computed the plain way: every block row's target distribution gathered by a
    Python loop over (anchor, k), full logits, F.cross_entropy / kl_div; D-PACE's weights by their
    definition, one block at a time. Returns (loss, weight sum)."""
    n_pos = batch.tokens
    ends = {int(a): int(batch.cu_seqlens[torch.searchsorted(batch.cu_seqlens, a, right=True)]) for a in batch.anchors}
    rows, teacher, labels, weights = [], [], [], []
    logits_t = batch.final.float() @ lm_head.T  # [T, V]
    for i, a in enumerate(batch.anchors.tolist()):
        for k in range(1, BLOCK):
            p = a + k
            if p >= ends[a] or p >= n_pos or not (prompt or batch.loss_mask[p]):
                continue
            rows.append(i * BLOCK + k)
            teacher.append(logits_t[p - 1])
            labels.append(int(batch.input_ids[p]) if batch.loss_mask[p] else int(logits_t[p - 1].argmax()))
            weights.append(float(np.exp(-(k - 1) / default_gamma(BLOCK))))
    logits = hidden[rows].float() @ lm_head.T
    q = torch.stack(teacher).log_softmax(-1)
    log_p = logits.log_softmax(-1)
    ce = F.cross_entropy(logits, torch.tensor(labels), reduction="none")
    l1 = (log_p.exp() - q.exp()).abs().sum(-1)
    per = {"none": ce, "kl": F.kl_div(log_p, q, log_target=True, reduction="none").sum(-1),
           "tv": 0.5 * l1, "dspark": 0.1 * ce + 0.9 * l1}[soft]
    w = torch.tensor(weights)
    if weights_kind == "dpace":  # w_k = sum over valid j >= k of prod over valid i <= j of (alpha + (1-alpha) p_i)
        w = torch.zeros(len(rows))
        block = [r // BLOCK for r in rows]
        for i in range(len(rows)):
            for j in range(i, len(rows)):
                if block[j] != block[i]:
                    break
                reach = 1.0
                for m in range(j + 1):
                    if block[m] == block[i]:
                        reach *= alpha + (1 - alpha) * float(torch.exp(-ce[m]))
                w[i] += reach
    return (per * w).sum(), w.sum()


def _run_args(store, target, out, *extra):
    return [f"--data.stores=[\"{store}\"]", f"--run.target=\"{target}\"", f"--run.out_dir=\"{out}\"",
            "--data.batch_tokens=1024", "--data.holdout_sequences=4", f"--drafter.block_size={BLOCK}", "--drafter.depth=1",
            "--objective.max_anchors=8", "--optim.max_steps=3", "--validation.every_steps=2", "--log.every_steps=1",
            "--log.progress=false", "--log.tensorboard=false", *extra]


def test_a_short_run_with_soft_targets_and_prompt_anchors_under_dpace(tiny_store_final, tiny_target, tmp_path):
    loop.run(load_config(TrainConfig, "configs/tiny.toml", _run_args(
        tiny_store_final, tiny_target, tmp_path / "run", "--targets.soft=dspark", "--targets.prompt_anchors=true")))
    records = read_metrics(tmp_path / "run")
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 3 and all(np.isfinite(r["loss"]) for r in train)
    assert any(r["kind"] == "val" and np.isfinite(r["tau"]) for r in records)


def test_soft_targets_from_a_store_without_final_states_is_one_sentence(tiny_store, tiny_target, tmp_path):
    for option in ("--targets.soft=kl", "--targets.prompt_anchors=true"):
        cfg = load_config(TrainConfig, "configs/tiny.toml",
                          _run_args(tiny_store, tiny_target, tmp_path / "r", option, "--objective.weights=gamma"))
        with pytest.raises(UserError, match="holds no final states.*--store.final_state=true"):
            loop.run(cfg)
