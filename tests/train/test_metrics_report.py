"""Metric records: the fixed line format, JSONL and TensorBoard, truncation on resume, the PNG report."""

from __future__ import annotations

import json

from train.metrics import MetricsWriter, format_train_line, read_metrics
from train.report import draw_report


def _train(step, loss=2.0):
    return {"kind": "train", "step": step, "epoch": 0, "loss": loss, "acc": 0.4, "acc_by_pos": [0.8, 0.5, 0.25],
            "tau": 2.1, "lr": 6e-4, "grad_norm": 0.7, "tok_s": 12345.0, "data_wait_ms": 1.5,
            "cache_hit_rate": 0.97, "gpu_mem_gib": None}


def test_the_line_carries_every_field():
    line = format_train_line(_train(5), 100)
    for part in ("step 5/100", "loss 2.0000", "acc 0.400", "acc@k .80 .50 .25", "tau 2.10", "lr 6.0e-04",
                 "gnorm 0.70", "12.3k tok/s", "wait 1.5 ms", "cache 97%", "mem -"):
        assert part in line, part


def test_jsonl_tensorboard_resume_truncation_and_report(tmp_path):
    w = MetricsWriter(tmp_path, 10, tensorboard=True, resume_step=0)
    for step in (2, 4, 6):
        w.write(_train(step, loss=3.0 - step / 10))
    w.write({"kind": "val", "step": 6, "loss": 2.5, "acc": 0.3, "acc_by_pos": [0.6, 0.3, 0.1], "tau": 1.8,
             "sequences": 8})
    w.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [2, 4, 6, 6]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    MetricsWriter(tmp_path, 10, tensorboard=False, resume_step=4).close()  # resumed from step 4
    assert [r["step"] for r in read_metrics(tmp_path)] == [2, 4]
    png = draw_report(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["loss"] == 2.8
