"""dflash-eval with the real DFlash drafter: an untrained drafter, exported and loaded back, drives
speculative decoding on the tiny target; its drafts match the training forward's predictions; the
output is the target's own greedy output; tau lies in [1, B]."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EVAL_BLOCK
from eval_helpers import batched_decodes_as_one_at_a_time
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_common.errors import UserError
from dflash_common.sampling import Sampling
from dflash_common.drafter.config import DrafterConfig
from dflash_common.drafter.model import DFlashDrafter
from dflash_common.tiny import MASK_TOKEN
from train.eval.batched import BatchedDFlash
from train.eval.cli import main
from train.eval.load import load_proposer
from train.eval.prompts import Prompt, load_prompts
from train.eval.run import Settings, decode_prompts
from train.eval.spec_decode import (
    DFlashProposer,
    TargetRunner,
    speculative_generate,
    target_generate,
)

BLOCK = EVAL_BLOCK  # the block size of the drafter_dir fixture (conftest.py)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    texts = ["Tell me about bees.", "Explain tides to a child.", "abc"]
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
        )
        for t in texts
    ], tok


@pytest.fixture(scope="module")
def trained(model, tiny_target):
    """A depth-1 drafter briefly trained on the tiny target's own answers: some drafts accepted."""
    from pathlib import Path

    tok, root = AutoTokenizer.from_pretrained(tiny_target), Path(__file__).resolve().parents[3]
    return _briefly_trained_drafter(model, tok, root)


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
        cu = torch.tensor([0, len(seq)])
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
        assert 1 + sum(spec.acceptance_lengths) >= len(spec.tokens)  # the last cycle counts uncut


def _eval_cli(tiny_target, drafter_dir, report, *options: str) -> dict:
    """dflash-eval's CLI on the tiny config's prompts -> the report."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    main(
        [
            "--config",
            str(root / "configs" / "tiny.toml"),
            "--drafter",
            str(drafter_dir),
            "--report",
            str(report),
            f"--target.path={tiny_target}",
            f"--prompts.files={root / 'data' / 'tiny-prompts.jsonl'}",
            *options,
        ]
    )
    return json.loads(report.read_text())


def test_cli_reports_tau_and_passes_the_lossless_check(tiny_target, drafter_dir, tmp_path, capsys):
    report = tmp_path / "out" / "eval.json"
    out = _eval_cli(
        tiny_target,
        drafter_dir,
        report,
        "--prompts.num_prompts=3",
        "--generation.max_new_tokens=20",
    )
    assert out["num_prompts"] == 3 and out["block_size"] == BLOCK
    assert 1 <= out["tau"] <= BLOCK
    assert out["lossless"] == {"checked": True, "ok": True, "mismatches": []}
    assert out["spec_tokens_per_s"] > 0 and out["target_tokens_per_s"] > 0 and out["speedup"] > 0
    assert out["run"]["config"]["drafter"]["path"] == str(drafter_dir)
    assert (report.parent / "eval.run.toml").is_file()
    captured = capsys.readouterr()
    assert "tau (acceptance length)" in captured.out
    assert (
        "x (tokens/s speculative / target alone: same engine, batch 1" in captured.out
    )  # says what it compares
    assert (
        "\r" not in captured.err and "prompt/s" not in captured.err
    )  # stderr is no terminal: no bar frames


def test_cli_draws_drafts_from_the_drafter_when_asked(tiny_target, drafter_dir, tmp_path):
    """--generation.draft_sampling=probabilistic (temperature > 0) decodes through the CLI and the
    report says how the drafts were made."""
    out = _eval_cli(
        tiny_target,
        drafter_dir,
        tmp_path / "eval.json",
        "--prompts.num_prompts=2",
        "--generation.max_new_tokens=16",
        "--generation.temperature=0.8",
        "--generation.draft_sampling=probabilistic",
    )
    assert out["sampling"]["draft_sampling"] == "probabilistic" and out["num_prompts"] == 2
    assert 1 <= out["tau"] <= BLOCK


def test_cli_block_size_override(tiny_target, drafter_dir, tmp_path):
    out = _eval_cli(
        tiny_target,
        drafter_dir,
        tmp_path / "eval.json",
        "--generation.block_size=3",
        "--prompts.num_prompts=1",
        "--generation.max_new_tokens=9",
        "--generation.warmup=false",
    )
    assert out["block_size"] == 3 and all(n <= 3 for n in out["prompts"][0]["acceptance_lengths"])


def test_drafter_for_another_target_is_refused_in_one_sentence(
    tiny_target_2layer, drafter_dir, capsys
):
    model2 = AutoModelForCausalLM.from_pretrained(tiny_target_2layer, dtype=torch.float32)
    with pytest.raises(
        UserError, match="made for another target.*num_target_layers 8 vs the target's 2"
    ):
        load_proposer(str(drafter_dir), model2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(
            [
                f"--target.path={tiny_target_2layer}",
                "--drafter",
                str(drafter_dir),
                "--prompts.files=data/tiny-prompts.jsonl",
            ]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "another target" in err and "Traceback" not in err
    assert "Loading weights" not in err, "the target is not loaded for a drafter that does not fit"


def test_a_drafter_with_a_hand_edited_config_is_refused_before_decoding(
    tiny_target, drafter_dir, tmp_path, capsys
):
    """A config.json whose block_size was removed would decode a block-4 drafter at 16: refused,
    naming it."""
    import shutil

    edited = shutil.copytree(drafter_dir, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    del config["block_size"]
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        main(
            [
                f"--target.path={tiny_target}",
                "--drafter",
                str(edited),
                "--prompts.files=data/tiny-prompts.jsonl",
                "--report",
                str(tmp_path / "eval.json"),
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and "Traceback" not in err
    assert (
        f"lacks `block_size`, which reads as 16, where its weights were trained with {BLOCK}" in err
    )
    assert not (tmp_path / "eval.json").exists()


def test_missing_drafter_is_one_sentence(tiny_target, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(
            [
                f"--target.path={tiny_target}",
                "--drafter",
                str(tmp_path / "nope"),
                "--prompts.files=data/tiny-prompts.jsonl",
            ]
        )
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err


def _briefly_trained_drafter(model, tok, root, steps=60):
    """A depth-1 drafter trained for a few dozen steps on the target's own responses
    (data/tiny-train.jsonl) with the training forward and the DFlash labels: good enough to get some
    drafts accepted."""
    from dflash_common.drafter.objective import IGNORE_INDEX, block_labels

    records = [
        json.loads(line)
        for line in (root / "data" / "tiny-train.jsonl").read_text().splitlines()[:48]
    ]
    cfg = DrafterConfig.from_target(
        model.config,
        mask_token_id=tok.convert_tokens_to_ids(MASK_TOKEN),
        depth=1,
        block_size=BLOCK,
        layer_ids=[1, 3, 5],
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    drafter.attach_frozen(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    with torch.inference_mode():
        feats = [
            torch.cat(_layers(model, r["input_ids"], cfg.target_layer_ids), -1) for r in records
        ]  # [S, K*H]
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        pick = torch.randperm(len(records), generator=gen)[:8].tolist()
        ids = torch.tensor(sum((records[i]["input_ids"] for i in pick), []))
        mask = torch.tensor(sum((records[i]["loss_mask"] for i in pick), [])).bool()
        cu = torch.tensor([0] + [len(records[i]["input_ids"]) for i in pick]).cumsum(0)
        pos = torch.arange(len(ids))
        end = cu[torch.searchsorted(cu, pos, right=True)]  # [T] end of each position's sequence
        # anchors: a third of the response positions with a whole block left (the rest next steps)
        anchors = torch.nonzero(mask.bool() & (pos <= end - BLOCK) & (pos % 3 == step % 3))[:, 0]
        labels, weights = block_labels(ids, mask, cu, anchors, BLOCK)
        hidden = drafter(torch.cat([feats[i] for i in pick]).clone(), ids, cu, anchors)  # [A, B, H]
        ce = torch.nn.functional.cross_entropy(
            drafter.logits(hidden).flatten(0, 1), labels.flatten().clamp(min=0), reduction="none"
        )
        loss = (ce * weights.flatten() * (labels.flatten() != IGNORE_INDEX)).sum() / weights.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def _layers(model, ids, layer_ids):
    states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return [states[i + 1][0] for i in layer_ids]


def test_every_cycle_accepts_what_the_training_forward_predicts(model, tiny_target, trained):
    """No training/serving mismatch: with a briefly trained drafter, each cycle's acceptance length
    is the leading run of the training forward's correct predictions at that cycle's anchor."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    tok = AutoTokenizer.from_pretrained(tiny_target)
    proposer = DFlashProposer(trained)
    target = TargetRunner(model, proposer.layer_ids)
    max_new, seen = 40, []
    for prompt in load_prompts([str(root / "data" / "tiny-prompts.jsonl")], tok, {}):
        out = speculative_generate(
            target, proposer, prompt.ids, block_size=BLOCK, max_new_tokens=max_new
        )
        assert out.tokens == target_generate(target, prompt.ids, max_new_tokens=max_new).tokens
        seq, max_len = prompt.ids + out.tokens, len(prompt.ids) + max_new
        anchors = (
            len(prompt.ids) + torch.tensor([0] + out.acceptance_lengths[:-1]).cumsum(0)
        ).tolist()
        with torch.inference_mode():
            feats = torch.cat(_layers(model, seq, proposer.layer_ids), -1)
            cu = torch.tensor([0, len(seq)])
            hidden = proposer.drafter(feats, torch.tensor(seq), cu, torch.tensor(anchors))
            predicted = proposer.drafter.logits(hidden[:, 1:]).argmax(-1)  # [cycles, B-1]
        for a, n, row in zip(anchors, out.acceptance_lengths, predicted.tolist()):
            if (
                a + BLOCK > max_len
            ):  # drafts past the output's end: nothing here to compare them with
                continue
            run = next((k for k in range(BLOCK - 1) if row[k] != seq[a + 1 + k]), BLOCK - 1)
            assert n == run + 1, (
                f"{prompt.name}: cycle at {a}"
            )  # counted uncut, as the authors' loop
            seen.append(n)
    assert max(seen) >= 3 and len(seen) > 50, (
        "the drafter should get drafts accepted for the check to bite"
    )


def test_batched_decoding_has_the_one_at_a_time_cycles(model, tiny_target, trained):
    """float32, the briefly trained drafter: through the batched loop every prompt's tokens and
    cycles (accepted lengths, cycle for cycle) are the one-at-a-time loop's, and the output is the
    target's own."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    tok = AutoTokenizer.from_pretrained(tiny_target)
    prompts = [p.ids for p in load_prompts([str(root / "data" / "tiny-prompts.jsonl")], tok, {})]
    single = batched_decodes_as_one_at_a_time(model, DFlashProposer(trained), prompts, BLOCK)
    seen = [n for a in single for n in a.acceptance_lengths]
    assert max(seen) >= 3, "the drafter should get drafts accepted for the check to bite"


def test_batched_drafter_blocks_equal_one_block_at_a_time(model, prompt_ids):
    """Sliding (causal, window 5) and full draft layers: the batched drafter's block hidden states
    and drafts, for rows of different lengths, each fed context past its anchor as the batched loop
    feeds it, equal the one-at-a-time drafter's."""
    texts, tok = prompt_ids
    block = 6
    cfg = DrafterConfig.from_target(
        model.config,
        mask_token_id=tok.convert_tokens_to_ids(MASK_TOKEN),
        depth=2,
        block_size=block,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=5,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    drafter.attach_frozen(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    proposer = DFlashProposer(drafter)
    prompts = [tok.encode(t) for t in texts]
    alone = TargetRunner(model, [])
    seqs = [p + target_generate(alone, p, max_new_tokens=20).tokens for p in prompts]
    with torch.inference_mode():
        feats = [torch.cat(_layers(model, q, cfg.target_layer_ids), -1) for q in seqs]  # [S, K*H]
    steps = [3, 6, 1]  # each row's second anchor: accepted lengths of a first cycle
    batch = BatchedDFlash(proposer)
    batch.start(prompts, max(map(len, seqs)) + 2 * block)
    width = max(map(len, prompts))
    padded = torch.stack(
        [
            torch.cat([f[: len(p)], f.new_zeros(width - len(p), f.shape[1])])
            for f, p in zip(feats, prompts)
        ]
    )
    batch.extend(padded, torch.zeros(len(prompts), dtype=torch.long))
    starts = torch.tensor([len(p) for p in prompts])
    first = batch.block_hidden(
        torch.tensor([q[len(p)] for q, p in zip(seqs, prompts)]), starts, block
    )
    # a whole block of context, as after a verify forward: past each second anchor it is stale
    batch.extend(torch.stack([f[len(p) : len(p) + block] for f, p in zip(feats, prompts)]), starts)
    second_starts = starts + torch.tensor(steps)
    anchors = torch.tensor([q[s] for q, s in zip(seqs, second_starts.tolist())])
    second = batch.block_hidden(anchors, second_starts, block)
    drafts = batch.propose_block(anchors, second_starts, block - 1)
    for i, (p, q, f) in enumerate(zip(prompts, seqs, feats)):
        cache, n, m = drafter.new_cache(), len(p), len(p) + steps[i]

        def ids(token):
            return torch.tensor([token] + [cfg.mask_token_id] * (block - 1))

        one = drafter.draft(cache, f[:n], ids(q[n]))
        torch.testing.assert_close(first[i], one, atol=2e-5, rtol=1e-4)
        one = drafter.draft(cache, f[n:m], ids(q[m]))
        torch.testing.assert_close(second[i], one, atol=2e-5, rtol=1e-4)
        proposer.begin(p)
        proposer.propose(f[:n], q[n], n, block - 1)
        assert drafts[i].tolist() == proposer.propose(f[n:m], q[m], m, block - 1).tolist()


def test_decode_prompts_batched_equals_one_at_a_time_with_multi_turn_prompts(
    model, drafter_dir, prompt_ids
):
    """run.py's batched path: turns decoded a wave at a time, answered by the speculative output,
    the results in the one-at-a-time order, every prompt's tokens and cycles the same, lossless."""
    texts, tok = prompt_ids
    proposer = load_proposer(str(drafter_dir), model)
    target = TargetRunner(model, proposer.layer_ids)
    items = [
        Prompt("a", ids=tok.encode(texts[0])),
        Prompt("b", turns=["Tell me about bees.", "And wasps?"]),
        Prompt("c", ids=tok.encode(texts[2])),
    ]
    one = Settings(BLOCK, Sampling(max_new_tokens=17), frozenset(), True, True)
    alone = decode_prompts(target, proposer, items, one, tokenizer=tok, warmup=False)
    two = Settings(BLOCK, Sampling(max_new_tokens=17), frozenset(), True, True, batch_size=2)
    together = decode_prompts(target, proposer, items, two, tokenizer=tok, warmup=True)
    assert [r.name for r in together] == [r.name for r in alone] == ["a", "b#turn1", "b#turn2", "c"]
    for a, b in zip(alone, together):
        assert b.spec.tokens == a.spec.tokens
        assert b.spec.acceptance_lengths == a.spec.acceptance_lengths
        assert b.spec.emitted == a.spec.emitted and b.prompt_tokens == a.prompt_tokens
        assert b.target.tokens == a.target.tokens and b.first_mismatch is None


def test_cli_batched(tiny_target, drafter_dir, tmp_path, capsys):
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    report = tmp_path / "eval.json"
    main(
        [
            "--config",
            str(root / "configs" / "tiny.toml"),
            "--drafter",
            str(drafter_dir),
            "--report",
            str(report),
            f"--target.path={tiny_target}",
            "--generation.batch_size=4",
            f"--prompts.files={root / 'data' / 'tiny-prompts.jsonl'}",
            "--prompts.num_prompts=5",
            "--generation.max_new_tokens=20",
            "--generation.warmup=false",
        ]
    )
    out = json.loads(report.read_text())
    assert out["batch_size"] == 4 and out["num_prompts"] == 5
    assert out["lossless"] == {"checked": True, "ok": True, "mismatches": []}
    assert out["spec_tokens_per_s"] > 0 and out["target_tokens_per_s"] > 0
    captured = capsys.readouterr()
    assert "batches of up to 4 prompts, tokens/s per prompt" in captured.out
    assert "\r" not in captured.err and "tok/s" not in captured.err  # no terminal: no bar frames
