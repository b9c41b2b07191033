"""dflash-eval with the real DFlash drafter: an untrained drafter, exported and loaded back, drives
speculative decoding on the tiny target; its drafts match the training forward's predictions; the
output is the target's own greedy output; tau lies in [1, B]."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dflash_common.cli import UserError
from dflash_common.drafter import DFlashDrafter, DrafterConfig
from dflash_common.export import save_drafter
from dflash_common.tiny import MASK_TOKEN
from train.evaluate import load_proposer, main
from train.spec_decode import TargetRunner, speculative_generate, target_generate

BLOCK = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from a second thread and lose much when the two cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory):
    """An untrained (random) DFlash drafter for the tiny target, exported in the released layout."""
    mask = AutoTokenizer.from_pretrained(tiny_target).convert_tokens_to_ids(MASK_TOKEN)
    cfg = DrafterConfig.from_target(AutoConfig.from_pretrained(tiny_target), mask_token_id=mask, depth=2,
                                    block_size=BLOCK)
    torch.manual_seed(0)
    return save_drafter(DFlashDrafter(cfg), tmp_path_factory.mktemp("drafter") / "export", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def model(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    texts = ["Tell me about bees.", "Explain tides to a child.", "abc"]
    return [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in texts], tok


def test_proposer_drafts_what_the_training_forward_predicts(model, drafter_dir, prompt_ids):
    """The KV-cached draft, fed context in two pieces, equals the packed training forward with one
    anchor: same positions, no shift, context strictly before the anchor."""
    texts, tok = prompt_ids
    proposer = load_proposer(str(drafter_dir), model)
    drafter = proposer.drafter
    ids = tok.encode(texts[0])
    seq = ids + target_generate(TargetRunner(model, []), ids, max_new_tokens=12).tokens
    with torch.inference_mode():
        states = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    feats = torch.cat([states[i + 1][0] for i in proposer.layer_ids], dim=-1)  # [T, K*H]
    first, second = len(ids), len(ids) + 5
    proposer.begin(ids)
    proposer.propose(feats[:first], seq[first], first, BLOCK - 1)
    drafts = proposer.propose(feats[first:second], seq[second], second, BLOCK - 1)
    with torch.inference_mode():
        cu = torch.tensor([0, len(seq)], dtype=torch.int32)
        hidden = drafter(feats, torch.tensor(seq), cu, torch.tensor([second]))  # [1, B, H]
        expected = drafter.logits(hidden[0, 1:]).argmax(-1)
    assert drafts.tolist() == expected.tolist()
    assert proposer.cache.length == second


def test_untrained_dflash_drafter_is_lossless_with_tau_in_range(model, drafter_dir, prompt_ids):
    texts, tok = prompt_ids
    proposer = load_proposer(str(drafter_dir), model)
    target = TargetRunner(model, proposer.layer_ids)
    for text in texts:
        ids = tok.encode(text)
        spec = speculative_generate(target, proposer, ids, block_size=BLOCK, max_new_tokens=33)
        assert spec.tokens == target_generate(target, ids, max_new_tokens=33).tokens
        assert all(1 <= n <= BLOCK for n in spec.acceptance_lengths)
        assert len(spec.tokens) == 1 + sum(spec.acceptance_lengths)


def test_cli_reports_tau_and_passes_the_lossless_check(tiny_target, drafter_dir, tmp_path, capsys):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    report = tmp_path / "out" / "eval.json"
    main(["--config", str(root / "configs" / "eval-tiny.toml"), "--drafter", str(drafter_dir),
          "--report", str(report), f"--target.path={tiny_target}",
          f"--prompts.files={root / 'data' / 'tiny-prompts.jsonl'}", "--prompts.num_prompts=3",
          "--generation.max_new_tokens=20"])
    out = json.loads(report.read_text())
    assert out["num_prompts"] == 3 and out["block_size"] == BLOCK
    assert 1 <= out["tau"] <= BLOCK
    assert out["lossless"] == {"checked": True, "ok": True, "mismatches": []}
    assert out["spec_tokens_per_s"] > 0 and out["target_tokens_per_s"] > 0 and out["speedup"] > 0
    assert out["run"]["config"]["drafter"]["path"] == str(drafter_dir)
    assert (report.parent / "eval.run.toml").is_file()
    assert "tau (acceptance length)" in capsys.readouterr().out


def test_cli_block_size_override(tiny_target, drafter_dir, tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    report = tmp_path / "eval.json"
    main(["--config", str(root / "configs" / "eval-tiny.toml"), "--drafter", str(drafter_dir),
          "--report", str(report), f"--target.path={tiny_target}", "--generation.block_size=3",
          f"--prompts.files={root / 'data' / 'tiny-prompts.jsonl'}", "--prompts.num_prompts=1",
          "--generation.max_new_tokens=9", "--generation.warmup=false"])
    out = json.loads(report.read_text())
    assert out["block_size"] == 3 and all(n <= 3 for n in out["prompts"][0]["acceptance_lengths"])


def test_drafter_for_another_target_is_refused_in_one_sentence(tiny_target_2layer, drafter_dir, capsys):
    model2 = AutoModelForCausalLM.from_pretrained(tiny_target_2layer, dtype=torch.float32)
    with pytest.raises(UserError, match="made for another target.*num_target_layers 8 vs the target's 2"):
        load_proposer(str(drafter_dir), model2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([f"--target.path={tiny_target_2layer}", "--drafter", str(drafter_dir),
              "--prompts.files=data/tiny-prompts.jsonl"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "another target" in err and "Traceback" not in err
    assert "Loading weights" not in err, "the target is not loaded for a drafter that does not fit"


def test_missing_drafter_is_one_sentence(tiny_target, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([f"--target.path={tiny_target}", "--drafter", str(tmp_path / "nope"),
              "--prompts.files=data/tiny-prompts.jsonl"])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
