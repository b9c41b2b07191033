"""dflash-eval --offline: the estimate from a store's held-out sequences, through the trainer's own
validation, with only the target's embedding and lm_head loaded."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EVAL_BLOCK

from train.eval.cli import main

BLOCK = EVAL_BLOCK  # the block size of the drafter_dir fixture (conftest.py)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_offline_estimate_reads_the_held_out_split_of_the_training_run(
    tiny_target, tiny_store, drafter_dir, tmp_path, capsys
):
    """--offline: accuracy per block position and tau from the trainer's validation, with the split
    the training run recorded in its run.toml (here 8 sequences), and the same figures as calling
    the trainer's validation directly with the target's head."""
    import shutil

    from dflash_common.drafter.export import load_drafter
    from dflash_common.drafter.target_head import load_target_head
    from train.eval.offline import evaluate_offline

    run_drafter = tmp_path / "run"
    shutil.copytree(drafter_dir, run_drafter)
    (run_drafter / "run.toml").write_text(
        "[data]\nholdout_sequences = 8\nbatch_tokens = 4096\n[objective]\nmax_anchors = 64\n"
    )
    report = tmp_path / "offline.json"
    main(
        [
            "--offline",
            "--store",
            str(tiny_store),
            "--drafter",
            str(run_drafter),
            f"--target.path={tiny_target}",
            "--report",
            str(report),
        ]
    )
    out = json.loads(report.read_text())
    assert out["mode"] == "offline" and out["holdout_sequences"] == 8 and 0 < out["sequences"] <= 8
    assert out["max_anchors"] == 64 and out["batch_tokens"] == 4096
    assert len(out["acc_by_pos"]) == BLOCK - 1 and all(0 <= a <= 1 for a in out["acc_by_pos"])
    assert 1 <= out["tau"] <= BLOCK and out["blocks"] > 0
    assert "tau (estimated)" in capsys.readouterr().out

    drafter, _ = load_drafter(drafter_dir, dtype=torch.float32)
    head = load_target_head(tiny_target, dtype=torch.float32)
    drafter.attach_frozen(head.embed, head.lm_head)
    # a run.toml without data.holdout_by is a run from before it: its split walked shard names
    assert out["holdout_by"] == "name"
    direct = evaluate_offline(
        drafter,
        tiny_store,
        holdout_sequences=8,
        holdout_by="name",
        batch_tokens=4096,
        max_anchors=64,
        autocast="none",
    )
    assert direct["tau"] == pytest.approx(out["tau"]) and direct["acc_by_pos"] == pytest.approx(
        out["acc_by_pos"]
    )

    main(
        [
            "--offline",
            "--store",
            str(tiny_store),
            "--drafter",
            str(run_drafter),
            f"--target.path={tiny_target}",
            "--report",
            str(report),
            "--offline.holdout_sequences=16",
        ]
    )  # the command line wins over run.toml
    assert json.loads(report.read_text())["sequences"] > out["sequences"]


def test_offline_without_a_store_is_one_sentence(tiny_target, drafter_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--offline", "--drafter", str(drafter_dir), f"--target.path={tiny_target}"])
    assert e.value.code == 2 and "--offline needs a store" in capsys.readouterr().err


def test_the_usage_line_shows_offline(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]  # argparse's `usage: dflash-eval [...]` lines
    assert (
        caught.value.code == 0 and usage.startswith("usage: dflash-eval") and "[--offline]" in usage
    )


def test_the_offline_split_follows_the_walk_the_run_recorded(tmp_path):
    """data.holdout_by from the training run's run.toml; a run.toml from before the option
    (no line for it) held out by shard names."""
    from train.eval.offline import _training_run_settings

    for text, want in (
        ('[data]\nholdout_by = "unit"\n', "unit"),
        ('[data]\nholdout_by = "name"\n', "name"),
        ("[data]\nholdout_sequences = 8\n", "name"),
    ):
        (tmp_path / "run.toml").write_text(text)
        assert _training_run_settings(str(tmp_path))["holdout_by"] == want, text
