"""A rerun into a run directory with checkpoints resumes it; a setting that defines what is trained
(optimiser, schedule, objective, data, seed) cannot change there, since the optimiser state, the
schedule and the data order go on from the checkpoint: the rerun is refused naming each setting.
Settings of how the run is carried out take their new values. Either way run.toml, run.json and the
checkpoints' run.toml say what was trained."""

from __future__ import annotations

import json
import os
import signal
import tomllib

import pytest
import tomli_w
import torch
from safetensors.torch import load_file

import train.loop as loop
from dflash_common.config import to_dict
from dflash_common.dirlock import LOCK_FILE
from dflash_common.dist import Ranks
from train.checkpoint import complete_checkpoints
from train.cli import main as train_main
from train.cli import parse
from train.metrics import read_metrics
from train.resume import changed_settings

from train_helpers import train_args

STEPS = [
    "--optim.max_steps=4",
    "--checkpoint.every_steps=2",
    "--optim.lr=3e-3",
    "--validation.every_steps=100",
]


@pytest.fixture(autouse=True)
def no_report(monkeypatch):
    monkeypatch.setattr(
        loop, "save_report", lambda *a, **k: None
    )  # drawing is not under test (and slow)


def _stopped_after_step_2(store, target, run, monkeypatch) -> None:
    """A run of STEPS stopped by SIGTERM after step 2, as a killed run that saved step-2."""
    real_step, calls = loop.train_step, []

    def step_then_sigterm(*a, **k):
        info = real_step(*a, **k)
        calls.append(1)
        if len(calls) == 2:
            os.kill(
                os.getpid(), signal.SIGTERM
            )  # the real handler: save at this step boundary, leave
        return info

    monkeypatch.setattr(loop, "train_step", step_then_sigterm)
    loop.run(parse(train_args(store, target, run, *STEPS)))
    monkeypatch.setattr(loop, "train_step", real_step)
    assert [s for s, _ in complete_checkpoints(run)] == [2]


def _files(run):
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_FILE}


def _toml(path):
    return tomllib.loads(path.read_text())


def test_a_setting_of_what_is_trained_is_refused_on_resume(
    tiny_store, tiny_target, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    _stopped_after_step_2(tiny_store, tiny_target, run, monkeypatch)
    capsys.readouterr()
    before = _files(run)
    with pytest.raises(SystemExit) as e:
        train_main(
            train_args(
                tiny_store,
                tiny_target,
                run,
                *STEPS,
                "--optim.lr=1e-3",
                "--run.seed=1",
                "--objective.gamma=5",
            )
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: ") and "Traceback" not in "\n".join(err)
    line = err[-1]
    assert f"cannot resume from {run / 'step-2'} with other settings of what it trains" in line
    for said in (
        "objective.gamma = unset there vs 5.0 here",
        "optim.lr = 0.003 there vs 0.001 here",
        "run.seed = 0 there vs 1 here",
    ):
        assert said in line, line
    assert f"rerun with the settings of {run / 'step-2' / 'run.toml'} to resume it" in line
    assert "another run directory (--out)" in line and "--checkpoint.resume=false" in line
    assert _files(run) == before  # nothing written, nothing lost

    # the way out it names: start over in the same directory, which then trains and records 1e-3
    loop.run(
        parse(
            train_args(
                tiny_store, tiny_target, run, *STEPS, "--optim.lr=1e-3", "--checkpoint.resume=false"
            )
        )
    )
    assert (
        f"checkpoint.resume = false: starting over in {run}, removing the earlier run's step-2"
        in (capsys.readouterr().err)
    )
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4]
    for step in (2, 4):  # both checkpoints are the new run's, not a step-2 left by the earlier one
        trainer = torch.load(run / f"step-{step}" / "trainer.pt", weights_only=True)
        assert trainer["scheduler"]["base_lrs"] == [1e-3]
        assert _toml(run / f"step-{step}" / "run.toml")["optim"]["lr"] == 1e-3
    assert _toml(run / "run.toml")["optim"]["lr"] == 1e-3
    assert json.loads((run / "run.json").read_text())["config"]["optim"]["lr"] == 1e-3
    train = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and max(r["lr"] for r in train) <= 1e-3


def test_settings_of_how_the_run_is_carried_out_take_their_new_values(
    tiny_store, tiny_target, tmp_path, monkeypatch, caplog
):
    straight = tmp_path / "straight"
    loop.run(parse(train_args(tiny_store, tiny_target, straight, *STEPS)))
    run = tmp_path / "run"
    _stopped_after_step_2(tiny_store, tiny_target, run, monkeypatch)
    caplog.set_level("INFO", logger="dflash")
    harmless = [
        "--log.every_steps=4",
        "--checkpoint.keep_last=1",
        "--data.reader_threads=1",
        "--validation.every_steps=1",
        "--data.cache_gb=8.0",
    ]
    caplog.clear()
    loop.run(parse(train_args(tiny_store, tiny_target, run, *STEPS, *harmless)))
    assert any(
        m.startswith("resuming from") and "log.every_steps (1 -> 4)" in m for m in caplog.messages
    )
    # the first line after the resume means steps 3 and 4 only, and says so
    assert any(
        m.startswith("step 4/4 (mean of 2 steps since the resume) | ep 1 | ")
        for m in caplog.messages
    )

    a = load_file(straight / "step-4" / "drafter" / "model.safetensors")
    b = load_file(run / "step-4" / "drafter" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same training as the uninterrupted run
    assert [s for s, _ in complete_checkpoints(run)] == [4]  # checkpoint.keep_last = 1 applied
    records = read_metrics(run)
    assert [r["step"] for r in records if r["kind"] == "train"] == [
        1,
        2,
        4,
    ]  # log.every_steps = 4 applied
    assert [r["step"] for r in records if r["kind"] == "val"] == [
        3,
        4,
    ]  # validation.every_steps = 1 applied
    for path in (run / "run.toml", run / "step-4" / "run.toml"):  # the files say what was used
        cfg = _toml(path)
        assert (cfg["log"]["every_steps"], cfg["checkpoint"]["keep_last"], cfg["optim"]["lr"]) == (
            4,
            1,
            3e-3,
        )
    was = _toml(straight / "run.toml")
    assert json.loads((run / "run.json").read_text())["resumes"] == [
        {
            "from": "step-2",
            "changed": {
                "checkpoint.keep_last": [was["checkpoint"]["keep_last"], 1],
                "data.cache_gb": [was["data"]["cache_gb"], 8.0],
                "data.reader_threads": [was["data"]["reader_threads"], 1],
                "log.every_steps": [1, 4],
                "validation.every_steps": [100, 1],
            },
        }
    ]


def test_a_schedule_of_another_length_is_refused(tiny_store, tiny_target, tmp_path):
    """Same settings, but the stores give another number of steps (shards added or removed since):
    the checkpoint's lr schedule would be stretched mid-run."""
    from dflash_common.errors import UserError

    run = tmp_path / "run"
    train_main(train_args(tiny_store, tiny_target, run, "--optim.max_steps=1"))
    one = Ranks(rank=0, world=1, device=torch.device("cpu"))
    with pytest.raises(UserError) as e:
        loop.resume(run / "step-1", one, None, None, None, total=5, out=run)
    assert str(e.value).startswith(
        f"cannot resume from {run / 'step-1'}: its learning-rate schedule spans 1 "
        "optimiser steps, but the stores now give 5 with its settings"
    )
    assert "--checkpoint.resume=false" in str(e.value)


def test_a_checkpoint_with_a_hand_edited_drafter_config_is_not_resumed(
    tiny_store, tiny_target, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    _stopped_after_step_2(tiny_store, tiny_target, run, monkeypatch)
    config_path = run / "step-2" / "drafter" / "config.json"
    config = json.loads(config_path.read_text())
    del config["block_size"]  # reads as 16: this block-4 drafter would resume as another
    config_path.write_text(json.dumps(config))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_main(train_args(tiny_store, tiny_target, run, *STEPS))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and line.startswith(f"error: {config_path} lacks `block_size`")
    assert line.endswith(f"delete {run / 'step-2'} to resume from an older checkpoint.")


def test_a_setting_added_since_the_checkpoint_resumes_at_its_default_only(tmp_path):
    """A checkpoint written before a setting existed has no line for it: that run trained as the
    setting's default does, so a resume at the default goes on and any other value is refused."""
    cfg = parse(train_args(tmp_path / "store", tmp_path / "target", tmp_path / "run", *STEPS))
    step = tmp_path / "run" / "step-2"
    step.mkdir(parents=True)
    old = to_dict(cfg)
    del old["optim"]["name"], old["optim"]["muon_momentum"]  # settings a later version added
    (step / "run.toml").write_text(tomli_w.dumps(old))
    assert changed_settings(step, cfg, tmp_path / "run") == {}
    muon = parse(
        train_args(
            tmp_path / "store", tmp_path / "target", tmp_path / "run", *STEPS, "--optim.name=muon"
        )
    )
    with pytest.raises(Exception, match=r"optim\.name = unset there vs 'muon' here"):
        changed_settings(step, muon, tmp_path / "run")


def test_a_run_from_before_holdout_by_resumes_only_with_the_walk_it_held_out_by(tmp_path):
    """data.holdout_by's default ('unit') is not what earlier runs did ('name'): a checkpoint
    without the line resumes only with --data.holdout_by=name, and the refusal says so."""
    args = (tmp_path / "store", tmp_path / "target", tmp_path / "run")
    cfg = parse(train_args(*args, *STEPS))
    step = tmp_path / "run" / "step-2"
    step.mkdir(parents=True)
    old = to_dict(cfg)
    del old["data"]["holdout_by"]
    (step / "run.toml").write_text(tomli_w.dumps(old))
    with pytest.raises(Exception) as e:
        changed_settings(step, cfg, tmp_path / "run")
    assert "data.holdout_by = 'name' there vs 'unit' here" in str(e.value)
    assert f"the settings of {step / 'run.toml'} and --data.holdout_by=name to resume" in str(
        e.value
    )
    by_name = parse(train_args(*args, *STEPS, "--data.holdout_by=name"))
    assert changed_settings(step, by_name, tmp_path / "run") == {}
