"""What a run reports: one fixed-format line per logging step, the same record in `metrics.jsonl`,
and TensorBoard scalars, all in the run directory.

    step 120/3000 | ep 1/6 | loss 2.3456 | acc 0.412 | acc@k .81 .62 .50 .41 .33 .27 .22 |
    tau 3.21 | lr 5.9e-04 | gnorm 0.83 | 182.3k tok/s | wait 1.2 ms | cache 97% | mem 12.3 GiB

Each line holds the means over the steps since the previous one (`log.every_steps`); a line over
fewer (the first after a resume, the last of the run) says so: `step 105/3000 (mean of 5 steps since
the resume) | ...`. Epochs count from 1 (the last step of a 6-epoch run is in `ep 6/6`); `mem` is
the peak GPU memory, `n/a (no GPU)` on a CPU.

Training records have "kind": "train", validation records "kind": "val". A resumed run first drops
the records written after its checkpoint, so the curves have no doubled steps.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dflash_common.fsutil import atomic_write_text

log = logging.getLogger("dflash")

METRICS_FILE = "metrics.jsonl"


def _positions(values: list[float]) -> str:
    """Per-position accuracies as a compact list: 0.8123 -> '.81' (1.0 -> '1.0')."""
    return " ".join("1.0" if v >= 0.995 else f"{v:.2f}".lstrip("0") for v in values)


def format_train_line(
    r: dict[str, Any],
    total_steps: int,
    *,
    epochs: int | None = None,
    every_steps: int | None = None,
    resumed_at: int = 0,
) -> str:
    """The console line of training record `r`; `epochs` the run's (none when optim.max_steps
    sets its length), `every_steps` the steps a line means, `resumed_at` the step resumed from."""
    mem = f"{r['gpu_mem_gib']:.1f} GiB" if r.get("gpu_mem_gib") is not None else "n/a (no GPU)"
    epoch = f"{r['epoch']}/{epochs}" if epochs else f"{r['epoch']}"
    return (
        f"step {r['step']}/{total_steps}{_window(r, every_steps, resumed_at)} | ep {epoch} | "
        f"loss {r['loss']:.4f}{_ce(r)} | acc {r['acc']:.3f} | "
        f"acc@k {_positions(r['acc_by_pos'])} | tau {r['tau']:.2f} | lr {r['lr']:.1e} | "
        f"gnorm {r['grad_norm']:.2f} | {r['tok_s'] / 1e3:.1f}k tok/s | "
        f"wait {r['data_wait_ms']:.1f} ms | "
        f"cache {100 * r['cache_hit_rate']:.0f}% | mem {mem}"
        + (f" | {r['bad_shards']} bad shard(s) skipped" if r.get("bad_shards") else "")
    )


def _ce(r: dict[str, Any]) -> str:
    """' | ce X': the CE of every block position alike, which train and val lines share (the loss
    is each one's own weighting)."""
    return f" | ce {r['ce']:.4f}" if r.get("ce") is not None else ""


def _window(r: dict[str, Any], every_steps: int | None, resumed_at: int) -> str:
    """' (mean of N steps[ since the resume])' for a line over fewer steps than the others."""
    n = round(r.get("steps") or 0)
    if every_steps is None or not 0 < n < every_steps:
        return ""
    since = " since the resume" if resumed_at and r["step"] - n == resumed_at else ""
    return f" (mean of {n} step{'' if n == 1 else 's'}{since})"


def format_val_line(r: dict[str, Any]) -> str:
    return (
        f"val  step {r['step']} | loss {r['loss']:.4f}{_ce(r)} | acc {r['acc']:.3f} | "
        f"acc@k {_positions(r['acc_by_pos'])} | tau {r['tau']:.2f}"
        + (f" | path tau {r['path_tau']:.2f}" if r.get("path_tau") is not None else "")
        + (
            f" | unary tau {r['tau_unary']:.2f} | top-k recall {r['top_k_recall']:.3f}"
            if r.get("tau_unary") is not None
            else ""
        )
        + f" | {r['sequences']} sequences"
    )


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl; a line that does not parse (a write cut by a kill or a full
    disk) is left out with a warning, so a resumed run still starts."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and "step" in record:
                records.append(record)
            else:
                log.warning(
                    "%s:%d is not a metrics record (a write cut short?); leaving it out", path, n
                )
    return records


class MetricsWriter:
    """Console line + JSONL + TensorBoard. Only rank 0 makes one; the others record nothing."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        tensorboard: bool,
        resume_step: int,
        *,
        epochs: int | None = None,
        every_steps: int | None = None,
    ):
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.line = {"epochs": epochs, "every_steps": every_steps, "resumed_at": resume_step}
        self._truncate_after(resume_step)
        self._file = open(run_dir / METRICS_FILE, "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events a killed run wrote after its last checkpoint
            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def _truncate_after(self, step: int) -> None:
        kept = [r for r in read_metrics(self.run_dir) if r["step"] <= step]
        atomic_write_text(
            self.run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept), durable=False
        )

    def write(self, record: dict[str, Any]) -> None:
        if record["kind"] == "train":
            line = format_train_line(record, self.total_steps, **self.line)
        else:
            line = format_val_line(record)
        log.info("%s", line)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._scalars(record)

    def _scalars(self, r: dict[str, Any]) -> None:
        step, kind = r["step"], r["kind"]
        for key, value in r.items():
            if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                self._tb.add_scalar(f"{kind}/{key}", value, step)
        for k, acc in enumerate(r.get("acc_by_pos", []), start=1):
            self._tb.add_scalar(f"{kind}/acc_pos_{k}", acc, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
