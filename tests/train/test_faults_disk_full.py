"""dflash-train on a full disk: one sentence naming the run directory and the checkpoint it will
resume from (exit 2), no half checkpoint visible, and after space is freed the same command finishes
the run with the uninterrupted losses. Once with a real small filesystem (a tmpfs, where mounting
one is allowed), once with the error injected (everywhere)."""

from __future__ import annotations

import errno
import json

import pytest
from train_helpers import train_args

import train.checkpoint as checkpoint
import train.loop as loop
from train.checkpoint import COMPLETE, complete_checkpoints
from train.cli import main as train_main
from train.cli import parse
from train.metrics import read_metrics

EXTRA = [
    "--optim.max_steps=6",
    "--checkpoint.every_steps=2",
    "--checkpoint.keep_last=1",
    "--validation.every_steps=3",
]


def _curve(run_dir):
    keys = ("kind", "step", "epoch", "loss", "acc", "acc_by_pos", "tau", "lr", "grad_norm")
    return [tuple(json.dumps(r.get(k)) for k in keys) for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def straight(tiny_store, tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("disk-full") / "straight"
    loop.run(parse(train_args(tiny_store, tiny_target, out, *EXTRA)))
    return _curve(out)


def _full_then_resumed(run, args, capsys, free_space, straight) -> None:
    with pytest.raises(SystemExit) as e:
        train_main(args)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith(
        f"error: no space left on the filesystem of {run}"
    ), err
    assert f"rerun the same command: it resumes from {run / 'step-2'}." in err
    assert [s for s, _ in complete_checkpoints(run)] == [2]
    assert all((p / COMPLETE).is_file() for p in run.glob("step-*"))  # nothing half is visible
    free_space()
    train_main(args)
    assert _curve(run) == straight and [s for s, _ in complete_checkpoints(run)] == [6]


def test_a_real_full_disk(small_disk, tiny_store, tiny_target, capsys, straight):
    disk = small_disk(
        "1200k"
    )  # one checkpoint of the tiny drafter (~0.75 MB) fits, a second beside it does not
    run = disk.path / "run"
    _full_then_resumed(
        run,
        train_args(tiny_store, tiny_target, run, *EXTRA),
        capsys,
        lambda: disk.resize("16m"),
        straight,
    )


def test_an_injected_full_disk_in_the_second_save(
    tiny_store, tiny_target, tmp_path, capsys, straight, monkeypatch
):
    real, calls = checkpoint._torch_save, []

    def no_space_on_the_fourth(
        obj, path
    ):  # trainer.pt and ranks.pt per save: the 4th is in step 4's
        calls.append(path)
        if len(calls) == 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(obj, path)

    monkeypatch.setattr(checkpoint, "_torch_save", no_space_on_the_fourth)
    run = tmp_path / "run"
    _full_then_resumed(
        run,
        train_args(tiny_store, tiny_target, run, *EXTRA),
        capsys,
        lambda: monkeypatch.setattr(checkpoint, "_torch_save", real),
        straight,
    )
    assert "step-4" in str(calls[3]) and not (run / "step-4").exists()
