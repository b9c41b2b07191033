"""Metric records: the fixed line format, JSONL and TensorBoard, truncation on resume, the PNG
report."""

from __future__ import annotations

import json

from train.metrics import MetricsWriter, format_train_line, read_metrics
from train.report import draw_report, save_report


def _train(step, loss=2.0, **extra):
    return {
        "kind": "train",
        "step": step,
        "epoch": 1,
        "loss": loss,
        "acc": 0.4,
        "acc_by_pos": [0.8, 0.5, 0.25],
        "tau": 2.1,
        "lr": 6e-4,
        "grad_norm": 0.7,
        "tok_s": 12345.0,
        "data_wait_ms": 1.5,
        "cache_hit_rate": 0.97,
        "gpu_mem_gib": None,
        **extra,
    }


def test_the_line_carries_every_field():
    line = format_train_line(_train(5), 100)
    for part in (
        "step 5/100",
        "loss 2.0000",
        "acc 0.400",
        "acc@k .80 .50 .25",
        "tau 2.10",
        "lr 6.0e-04",
        "gnorm 0.70",
        "12.3k tok/s",
        "wait 1.5 ms",
        "cache 97%",
        "mem n/a (no GPU)",
    ):
        assert part in line, part


def test_jsonl_tensorboard_resume_truncation_and_report(tmp_path):
    w = MetricsWriter(tmp_path, 10, tensorboard=True, resume_step=0)
    for step in (2, 4, 6):
        w.write(_train(step, loss=3.0 - step / 10))
    w.write(
        {
            "kind": "val",
            "step": 6,
            "loss": 2.5,
            "acc": 0.3,
            "acc_by_pos": [0.6, 0.3, 0.1],
            "tau": 1.8,
            "sequences": 8,
        }
    )
    w.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [2, 4, 6, 6]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    MetricsWriter(tmp_path, 10, tensorboard=False, resume_step=4).close()  # resumed from step 4
    assert [r["step"] for r in read_metrics(tmp_path)] == [2, 4]
    png = save_report(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["loss"] == 2.8


def test_the_line_says_a_shorter_window_the_epoch_from_one_and_a_unit():
    """After a resume the first line means fewer steps than the others, and says so; epochs count
    from 1 (the last step of a 4-epoch run is in epoch 4 of 4); memory has its unit or says why
    not."""
    line = format_train_line(
        _train(110, steps=5.0, epoch=4), 3000, epochs=4, every_steps=10, resumed_at=105
    )
    assert line.startswith("step 110/3000 (mean of 5 steps since the resume) | ep 4/4 | ")
    end = format_train_line(_train(3000, steps=1.0), 3000, every_steps=10, resumed_at=105)
    assert end.startswith("step 3000/3000 (mean of 1 step) | ep 1 | ")  # the last, shorter window
    full = format_train_line(
        _train(120, steps=10.0, gpu_mem_gib=12.34), 3000, every_steps=10, resumed_at=105
    )
    assert full.startswith("step 120/3000 | ") and full.endswith("mem 12.3 GiB")


def test_the_loss_panel_says_what_each_loss_weighs_and_steps_are_whole(tmp_path):
    import tomli_w

    from dflash_common.config import to_dict
    from train.config import TrainConfig

    w = MetricsWriter(tmp_path, 3, tensorboard=False, resume_step=0)
    for step in (1, 2, 3):
        w.write(_train(step, loss=3.0 - step / 10))
    w.write(
        {
            "kind": "val",
            "step": 3,
            "loss": 3.5,
            "acc": 0.3,
            "acc_by_pos": [0.6, 0.3, 0.1],
            "tau": 1.8,
            "sequences": 8,
        }
    )
    w.close()
    (tmp_path / "run.toml").write_text(tomli_w.dumps(to_dict(TrainConfig())))  # the default: D-PACE
    fig = draw_report(tmp_path)
    fig.canvas.draw()
    loss = fig.axes[0]
    legend = [t.get_text() for t in loss.get_legend().get_texts()]
    assert legend == ["train (objective: D-PACE weights)", "validation (gamma weights)"]
    assert "weigh block positions differently" in loss.get_title()
    for ax in fig.axes:  # steps (and block positions) are whole numbers: no 1.25, 1.5 ticks
        assert all(float(t).is_integer() for t in ax.get_xticks()), ax.get_xticks()
    cfg = to_dict(TrainConfig())
    cfg["objective"]["weights"] = "gamma"
    (tmp_path / "run.toml").write_text(tomli_w.dumps(cfg))
    loss = draw_report(tmp_path).axes[0]
    legend = [t.get_text() for t in loss.get_legend().get_texts()]
    assert legend[0] == "train (objective: gamma weights)"
    assert loss.get_title() == ""  # the same weights: one scale


def test_train_and_val_lines_show_the_ce_and_the_loss_panel_draws_it_when_records_have_it(tmp_path):
    """`ce` weighs every block position alike in both records: the panel draws it for train and
    validation on one comparable axis (the objective's own loss stays in the line and the JSON)."""
    from train.metrics import format_val_line

    assert "loss 2.0000 | ce 3.2500 | acc" in format_train_line(_train(5, ce=3.25), 100)
    val = {
        "kind": "val",
        "step": 3,
        "loss": 3.5,
        "ce": 3.3,
        "acc": 0.3,
        "acc_by_pos": [0.6, 0.3, 0.1],
        "tau": 1.8,
        "sequences": 8,
    }
    assert "loss 3.5000 | ce 3.3000 | acc" in format_val_line(val)
    w = MetricsWriter(tmp_path, 3, tensorboard=False, resume_step=0)
    for step in (1, 2, 3):
        w.write(_train(step, loss=0.8, ce=3.0 + step / 10))
    w.write(val)
    w.close()
    loss = draw_report(tmp_path).axes[0]
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["train", "validation"]
    assert loss.get_ylabel() == "cross-entropy" and "alike" in loss.get_title()
    assert [float(y) for y in loss.get_lines()[0].get_ydata()] == [3.1, 3.2, 3.3]
