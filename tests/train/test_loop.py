"""dflash-train end to end on the tiny target and real stores: exact resume, SIGTERM, two ranks
under torchrun, two differently shaped drafters from one untouched store, user errors, and the
offline estimate agreeing with the trainer's own validation."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train.loop as loop
from dflash_common.drafter.export import load_drafter
from dflash_common.drafter.target_head import load_target_head
from train.checkpoint import complete_checkpoints
from train.cli import main, parse
from train.config import TrainConfig
from train.eval.offline import evaluate_offline
from train.metrics import read_metrics
from train_helpers import write_tiny_store, train_args

ROOT = Path(__file__).resolve().parents[2]


_args = train_args


def _cfg(*args) -> TrainConfig:
    return parse(list(args))


def _curve(run_dir):
    keys = ("kind", "step", "epoch", "loss", "ce", "acc", "acc_by_pos", "tau", "lr", "grad_norm")
    return [tuple(json.dumps(r.get(k)) for k in keys) for r in read_metrics(run_dir)]


# every lever of issue 17 that is not the default, so that resume is proven with them too
LEVERS = [
    "--objective.anchors=label",
    "--objective.weights=gamma",
    "--objective.normalise=anchors",
    "--regularise.noise=0.1",
    "--regularise.ema=0.9",
    "--precision.loss_method=odds",
    "--optim.name=muon",
]


@pytest.mark.parametrize("levers", [[], LEVERS], ids=["recipe", "levers"])
def test_stop_and_resume_repeats_the_uninterrupted_losses_bit_for_bit(
    tiny_store, tiny_target, tmp_path, monkeypatch, levers
):
    extra = [
        "--optim.max_steps=8",
        "--optim.grad_accum=2",
        "--validation.every_steps=4",
        "--checkpoint.every_steps=100",
        *levers,
    ]
    loop.run(_cfg(*_args(tiny_store, tiny_target, tmp_path / "straight", *extra)))

    real_step, calls = loop.train_step, []

    def step_then_sigterm(*a, **k):
        info = real_step(*a, **k)
        calls.append(info.epoch)
        if len(calls) == 3:
            os.kill(
                os.getpid(), signal.SIGTERM
            )  # the real handler: save at this step boundary, leave
        return info

    monkeypatch.setattr(loop, "train_step", step_then_sigterm)
    stopped = tmp_path / "stopped"
    loop.run(_cfg(*_args(tiny_store, tiny_target, stopped, *extra)))
    assert [s for s, _ in complete_checkpoints(stopped)] == [3] and not (
        stopped / "drafter"
    ).exists()
    monkeypatch.setattr(loop, "train_step", real_step)
    loop.run(
        _cfg(*_args(tiny_store, tiny_target, stopped, *extra))
    )  # the same command again: resumes

    straight = _curve(tmp_path / "straight")
    assert (
        len(straight) == 8 + 2 and _curve(stopped) == straight
    )  # 8 train + 2 val records, all equal
    assert len({r["epoch"] for r in read_metrics(stopped) if r["kind"] == "train"}) >= 2
    a = load_file(tmp_path / "straight" / "step-8" / "drafter" / "model.safetensors")
    b = load_file(stopped / "step-8" / "drafter" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = load_file(stopped / "step-3" / "drafter" / "model.safetensors")
    assert not all(torch.equal(first[k], b[k]) for k in b)
    if levers:
        _check_the_average_is_resumed_and_exported(tmp_path / "straight", stopped, b)

    # the offline estimate reads the same held-out sequences with the same anchors as validation did
    drafter, _ = load_drafter(stopped / "step-8")
    head = load_target_head(tiny_target)
    drafter.attach_frozen(head.embed, head.lm_head)
    offline = evaluate_offline(
        drafter, tiny_store, max_anchors=8, holdout_sequences=4, batch_tokens=1024, autocast="none"
    )
    val = [r for r in read_metrics(stopped) if r["kind"] == "val"][-1]
    for key in ("loss", "ce", "acc", "tau", "acc_by_pos", "sequences"):
        assert offline[key] == pytest.approx(val[key], rel=1e-6), key
    assert all(0 < r["ce"] < 20 for r in read_metrics(stopped))  # every record, train and val


def _check_the_average_is_resumed_and_exported(
    straight: Path, stopped: Path, average: dict
) -> None:
    """With an EMA, a checkpoint's drafter/ is the average and trainer.pt the trained weights, which
    resume as an uninterrupted run has them; the final drafter is the average (as bf16)."""
    trained = [
        torch.load(run / "step-8" / "trainer.pt", weights_only=True)["trained_weights"]
        for run in (straight, stopped)
    ]
    assert trained[0].keys() == average.keys() and all(
        torch.equal(trained[0][k], trained[1][k]) for k in average
    )
    assert not all(torch.equal(trained[1][k], average[k]) for k in average)
    final = load_file(stopped / "drafter" / "model.safetensors")
    assert all(torch.equal(final[k], average[k].to(torch.bfloat16)) for k in average)


def test_epochs_count_from_one_and_the_last_step_is_in_the_last(
    tiny_store, tiny_target, tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(loop, "save_report", lambda *a, **k: None)  # not under test (and slow)
    caplog.set_level("INFO", logger="dflash")
    loop.run(
        _cfg(
            *_args(
                tiny_store,
                tiny_target,
                tmp_path / "run",
                "--optim.epochs=2",
                "--validation.every_steps=0",
                "--checkpoint.every_steps=1000",
            )
        )
    )
    train = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert train[0]["epoch"] == 1 and train[-1]["epoch"] == 2
    assert {r["epoch"] for r in train} == {1, 2}
    last = [m for m in caplog.messages if m.startswith(f"step {train[-1]['step']}/")]
    assert last and f"/{train[-1]['step']} | ep 2/2 | " in last[0] and "mem n/a (no GPU)" in last[0]


def _store_fingerprint(path: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(path)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_two_drafters_of_other_shapes_from_one_store_which_stays_untouched(
    tiny_store, tiny_target, tmp_path
):
    before = _store_fingerprint(tiny_store)
    runs = {
        "a": (
            ["--drafter.layer_ids=[1,3,5]", "--drafter.block_size=4", "--drafter.depth=1"],
            4,
            [1, 3, 5],
            1,
        ),
        "b": (
            [
                "--drafter.layer_ids=[4,2]",
                "--drafter.block_size=8",
                "--drafter.depth=2",
                "--optim.lr=3e-4",
            ],
            8,
            [4, 2],
            2,
        ),
    }
    for name, (extra, *_) in runs.items():
        main(_args(tiny_store, tiny_target, tmp_path / name, "--optim.max_steps=3", *extra))
    assert _store_fingerprint(tiny_store) == before  # every file: same bytes, same mtime
    for name, (_, block, layers, depth) in runs.items():
        config = json.loads((tmp_path / name / "drafter" / "config.json").read_text())
        assert (
            config["block_size"],
            config["dflash_config"]["target_layer_ids"],
            config["num_hidden_layers"],
        ) == (block, layers, depth)
        weights = load_file(tmp_path / name / "drafter" / "model.safetensors")
        assert weights["fc.weight"].shape == (64, 64 * len(layers))
        train = [r for r in read_metrics(tmp_path / name) if r["kind"] == "train"]
        assert len(train[-1]["acc_by_pos"]) == block - 1


def test_user_errors_are_one_sentence(tiny_store, tiny_target, tmp_path, capsys):
    cases = [
        (["--store", str(tmp_path / "nowhere")], "does not exist"),
        (["--drafter.layer_ids=[6]"], "layers"),
        (["--run.target=" + str(tmp_path)], "run.target"),
        (["--data.cache_gb=0.0001"], "data.cache_gb"),
    ]
    for extra, fragment in cases:
        with pytest.raises(SystemExit) as e:
            main(_args(tiny_store, tiny_target, tmp_path / "run", "--optim.max_steps=1", *extra))
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and fragment in err and err.startswith("error:"), err


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_sigterm_saves_and_exits_zero(tiny_store, tiny_target, tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "train.cli",
        *_args(
            tiny_store,
            tiny_target,
            out,
            "--optim.max_steps=100000",
            "--checkpoint.every_steps=100000",
        ),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if " step 2/" in line:
            proc.send_signal(signal.SIGTERM)
            break
    _, rest = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert proc.returncode == 0, text
    steps = [s for s, _ in complete_checkpoints(out)]
    assert len(steps) == 1 and f"checkpoint saved in {out / f'step-{steps[0]}'}" in text
    assert "Traceback" not in text


def test_two_ranks_under_torchrun_with_gloo(tiny_store, tiny_target, tmp_path):
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
        ),
    ]
    started = time.time()
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[rank 1]" in done.stderr
    ranks = torch.load(out / "step-3" / "ranks.pt", weights_only=True)
    assert (
        len(ranks) == 2 and ranks[0]["data"] == ranks[1]["data"]
    )  # same position in their own plans
    train = [r for r in read_metrics(out) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(r["loss"] > 0 for r in train)
    assert time.time() - started < 240


def test_an_fp8_store_trains_as_its_bf16_twin(tiny_store_fp8, tiny_target, tmp_path):
    """The same run from an fp8 store and from a bf16 store of the same records: the losses agree
    within the effect of fp8's rounding. e4m3 keeps 3 mantissa bits, so with its per-token scale
    each feature is within 2^-4 of its value (relative; bf16's 2^-8 is negligible beside it): fp8
    perturbs every token's features of each layer by at most 2^-4 of their norm. The bound on the
    losses comes from the run itself: the bf16 run with regularise.noise = 2^-4 adds Gaussian noise
    of that very size (std 2^-4 of each token's per-layer RMS), and fp8 may move no step's loss
    further than that noise moves some step's. A wrong feature path (another layer order, a bad
    decode) moves them by percents, tens of times more."""
    twin = write_tiny_store(tmp_path / "bf16-twin", tiny_target, n_shards=4, first_record=48)
    runs = {
        "fp8": (tiny_store_fp8, []),
        "bf16": (twin, []),
        "noise": (twin, [f"--regularise.noise={2**-4}"]),
    }
    losses = {}
    for name, (store, extra) in runs.items():
        main(
            _args(
                store,
                tiny_target,
                tmp_path / name,
                "--optim.max_steps=3",
                "--data.gpu_prefetch=0",
                *extra,
            )
        )
        train = [r["loss"] for r in read_metrics(tmp_path / name) if r["kind"] == "train"]
        losses[name] = torch.tensor(train, dtype=torch.float64)
    assert len(losses["bf16"]) == 3
    fp8_moves = ((losses["fp8"] - losses["bf16"]).abs() / losses["bf16"]).max()
    noise_moves = ((losses["noise"] - losses["bf16"]).abs() / losses["bf16"]).max()
    assert 0 < fp8_moves <= noise_moves, (losses, fp8_moves, noise_moves)  # 0: fp8 did round


def test_help_lists_every_config_field():
    done = subprocess.run(
        [sys.executable, "-m", "train.cli", "--help"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    for key in (
        "--store",
        "--out",
        "--data.cache_gb",
        "--drafter.layer_ids",
        "--optim.grad_accum",
        "--run.target",
    ):
        assert key in done.stdout
