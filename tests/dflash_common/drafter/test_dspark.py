"""The DSpark drafter (dspark.py): its config.json keys and round trip, its weights' released names
and shapes (vLLM 0.32's `qwen3_dspark.py` table), the backbone unchanged, and greedy Markov drafting
and confidences against a plain loop over the materialised logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_common.config import ConfigError
from dflash_common.drafter.arch import class_of_json, config_class, config_from_json, new_drafter
from dflash_common.drafter.dspark import DSparkConfig, DSparkDrafter, confident_prefix
from dflash_common.drafter.model import DFlashDrafter

from drafter_testlib import ANCHORS, TINY_MASK_ID, packed_batch

RANK = 8


def dspark_config(target_dir: Path, **overrides) -> DSparkConfig:
    options = dict(mask_token_id=TINY_MASK_ID, depth=2, block_size=4, markov_rank=RANK)
    options.update(overrides)
    return config_class("dspark").from_target(
        json.loads((Path(target_dir) / "config.json").read_text()), **options
    )


def dspark_drafter(cfg: DSparkConfig, seed: int = 0) -> DSparkDrafter:
    torch.manual_seed(seed)
    drafter = new_drafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if not name.endswith("norm.weight"):
                # a larger init, and a Markov bias that decides drafts
                p.mul_(5.0 if name.startswith("layers") else 40.0)
    g = torch.Generator().manual_seed(seed + 1)
    drafter.attach_frozen(
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
    )
    return drafter


def test_config_json_has_the_keys_vllm_reads_and_reads_back(tiny_target):
    cfg = dspark_config(tiny_target, confidence_head_with_markov=False)
    assert isinstance(cfg, DSparkConfig) and cfg.arch == "dspark"
    assert (cfg.verify_block_size, cfg.num_drafts) == (5, 4)  # the anchor row predicts: B drafts
    data = cfg.to_config_json()
    assert data["architectures"] == ["Qwen3DSparkModel"] and data["model_type"] == "qwen3"
    assert (data["markov_rank"], data["markov_head_type"]) == (RANK, "vanilla")
    assert data["enable_confidence_head"] is True and data["confidence_head_with_markov"] is False
    assert data["sample_from_anchor"] is True and "sample_from_anchor" not in data["dflash_config"]
    assert data["target_layer_ids"] == data["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]
    assert data["mask_token_id"] == data["dflash_config"]["mask_token_id"] == TINY_MASK_ID
    assert data["block_size"] == 4  # vLLM's default num_speculative_tokens for DSpark: B drafts
    assert config_from_json(json.loads(json.dumps(data))) == cfg
    dflash = config_class("dflash").from_target(
        json.loads((Path(tiny_target) / "config.json").read_text()), mask_token_id=TINY_MASK_ID
    )
    assert (
        config_from_json(dflash.to_config_json()) == dflash
        and dflash.verify_block_size == dflash.block_size
    )


def test_config_json_without_the_markov_rank_or_with_another_head_is_refused(tiny_target):
    data = dspark_config(tiny_target).to_config_json()
    for change, match in (
        ({"markov_rank": None}, "no markov_rank"),
        ({"markov_head_type": "gated"}, "vanilla"),
        ({"sample_from_anchor": False}, "sample_from_anchor"),
    ):
        with pytest.raises(ConfigError, match=match):
            config_from_json({**data, **change})
    absent = {
        k: v
        for k, v in data.items()
        if k not in ("enable_confidence_head", "confidence_head_with_markov")
    }
    assert config_from_json(absent).confidence_head is False  # vLLM's defaults: no head
    with pytest.raises(ConfigError, match="unknown"):
        config_class("medusa")


def test_the_class_of_a_config_json_is_read_from_its_architectures_alone(tiny_target):
    """The vLLM engine picks its model runner by the class before vLLM reads the config: a config
    our reader would refuse (no rope theta) still names its class, so vLLM's own refusal or
    behaviour is what a serving check sees."""
    data = dspark_config(tiny_target).to_config_json()
    data.pop("rope_theta", None)
    data.pop("rope_parameters", None)
    with pytest.raises(ConfigError, match="rope_theta"):
        config_from_json(data)
    assert class_of_json(data) is DSparkConfig and DSparkConfig.V2_RUNNER
    assert class_of_json({}) is config_class("dflash")


@pytest.mark.parametrize("with_markov", [True, False])
def test_weights_have_vllms_names_and_shapes(tiny_target, with_markov):
    cfg = dspark_config(tiny_target, confidence_head_with_markov=with_markov)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in new_drafter(cfg).state_dict().items()}
        backbone = {
            n: tuple(p.shape)
            for n, p in DFlashDrafter(
                config_class("dflash").from_target(
                    json.loads((Path(tiny_target) / "config.json").read_text()),
                    mask_token_id=TINY_MASK_ID,
                    depth=2,
                    block_size=4,
                )
            )
            .state_dict()
            .items()
        }
    v, h = cfg.vocab_size, cfg.hidden_size
    heads = {
        "markov_head.markov_w1.weight": (v, RANK),
        "markov_head.markov_w2.weight": (v, RANK),
        "confidence_head.proj.weight": (1, h + (RANK if with_markov else 0)),
        "confidence_head.proj.bias": (1,),
    }
    assert shapes == {**backbone, **heads}
    without = dspark_config(tiny_target, confidence_head=False)
    with torch.device("meta"):
        assert not any(n.startswith("confidence_head") for n in new_drafter(without).state_dict())


def test_the_backbone_is_dflashs_and_the_heads_start_small(tiny_target):
    cfg = dspark_config(tiny_target)
    torch.manual_seed(0)
    dspark = new_drafter(cfg)
    std = cfg.initializer_range
    assert type(dspark) is DSparkDrafter
    for p in (dspark.markov_head.markov_w1.weight, dspark.markov_head.markov_w2.weight):
        assert abs(float(p.detach().std()) - std) < 0.2 * std
    assert float(dspark.confidence_head.proj.bias.detach()) == 0.0
    plain = DFlashDrafter(
        config_class("dflash").from_target(
            json.loads((Path(tiny_target) / "config.json").read_text()),
            mask_token_id=TINY_MASK_ID,
            depth=2,
            block_size=4,
        )
    )
    plain.load_state_dict({k: v for k, v in dspark.state_dict().items() if k in plain.state_dict()})
    g = torch.Generator().manual_seed(5)
    embed, head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) for _ in range(2))
    for d in (dspark, plain):
        d.attach_frozen(embed, head)
    context, input_ids, cu = packed_batch(cfg)
    with torch.no_grad():
        torch.testing.assert_close(
            dspark(context, input_ids, cu, torch.tensor(ANCHORS)),
            plain(context, input_ids, cu, torch.tensor(ANCHORS)),
        )


def test_greedy_drafts_and_confidences_follow_the_markov_chain(tiny_target):
    """Draft k = argmax(lm_head(h_k) + W2 W1[draft k-1]), the anchor before draft 0; confidence k =
    sigmoid(proj([h_k ; W1[draft k-1]])), against a plain loop; the Markov term must decide some
    drafts."""
    cfg = dspark_config(tiny_target)
    drafter = dspark_drafter(cfg)
    hidden = torch.randn(
        3, cfg.block_size, cfg.hidden_size, generator=torch.Generator().manual_seed(2)
    )
    anchors = torch.tensor([7, 100, 259])
    drafts = drafter.greedy_drafts(hidden, anchors)
    conf = drafter.draft_confidences(hidden, anchors, drafts)
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    proj = drafter.confidence_head.proj
    for i in range(3):
        prev = int(anchors[i])
        for k in range(cfg.block_size):
            logits = hidden[i, k] @ drafter.lm_head_weight.T + w2 @ w1[prev]
            want_conf = torch.sigmoid(
                proj.weight[0] @ torch.cat([hidden[i, k], w1[prev]]) + proj.bias[0]
            )
            assert int(drafts[i, k]) == int(logits.argmax())
            torch.testing.assert_close(conf[i, k], want_conf.detach(), rtol=1e-5, atol=1e-6)
            prev = int(drafts[i, k])
    base = (hidden @ drafter.lm_head_weight.T).argmax(-1)
    assert not torch.equal(base, drafts)
    assert confident_prefix(torch.tensor([0.9, 0.8, 0.3, 0.95]), 0.5) == 2
    assert (
        confident_prefix(torch.tensor([0.9, 0.8]), 0.0) == 2
        and confident_prefix(torch.tensor([0.1]), 0.5) == 0
    )


def test_cached_drafting_gives_the_training_forward_rows(tiny_target):
    """greedy_draft through the KV cache: B drafts from the block [anchor, MASK x (B-1)], the same
    as the Markov chain over the training forward's rows of that anchor."""
    cfg = dspark_config(tiny_target)
    drafter = dspark_drafter(cfg)
    context, input_ids, cu = packed_batch(cfg)
    with torch.no_grad():
        rows = drafter(context, input_ids, cu, torch.tensor([13]))  # sequence 1 starts at 11
        want = drafter.greedy_drafts(rows, input_ids[13:14])[0]
        cache = drafter.new_cache()
        got = drafter.greedy_draft(cache, context[11:13], int(input_ids[13]))
    assert got.shape == (cfg.block_size,) and torch.equal(got, want)
