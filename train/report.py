"""A one-page PNG of a run, `report.png` in the run directory: loss and accuracy over steps (train
and validation), accuracy by block position (latest), and the estimated acceptance length tau over
steps (with validation's path tau, greedy decoding replayed from the held-out responses). Written at
every checkpoint and at the end of the run, from `metrics.jsonl` (and `run.toml`, whose [objective]
says what the training loss weighs). The loss panel draws the CE of every block position alike for
train and validation (`ce`: the two compare, so a gap between them is overfitting); for records
without it, each one's own loss (D-PACE weights by default in training, gamma weights in
validation), the legend saying which.

    python -m train.report RUN_DIR
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

from dflash_common.fsutil import temp_sibling

from train.metrics import read_metrics

REPORT_FILE = "report.png"


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    return [r["step"] for r in records], [r[key] for r in records]


def save_report(run_dir: str | Path, title: str | None = None) -> Path | None:
    """Draw the run's curves into run_dir/report.png (atomically); None if there is nothing to draw
    yet."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    fig = draw_report(run_dir, title)
    if fig is None:
        return None
    path = run_dir / REPORT_FILE
    tmp = temp_sibling(path).with_suffix(".png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(path)
    return path


def draw_report(run_dir: str | Path, title: str | None = None):
    """The report's matplotlib figure, from run_dir/metrics.jsonl (and run.toml, which says what
    the training loss weighs); None if there is nothing to draw yet."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    if not train and not val:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    loss_key = "ce" if all(r.get("ce") is not None for r in train + val) else "loss"
    if loss_key == "ce":  # every block position alike in both: one scale
        losses, comparable = {"train": "train", "validation": "validation"}, True
    else:
        losses, comparable = loss_labels(run_dir)
    panels = (
        (axes[0, 0], loss_key, "cross-entropy" if loss_key == "ce" else "loss"),
        (axes[0, 1], "acc", "accuracy"),
        (axes[1, 1], "tau", "tau"),
    )
    for ax, key, label in panels:
        for records_, name, style in ((train, "train", "-"), (val, "validation", "o-")):
            if records_:
                name = losses[name] if key == loss_key else name
                ax.plot(*_series(records_, key), style, label=name, markersize=4)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole, also on short runs
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    if loss_key == "ce":
        axes[0, 0].set_title("cross-entropy to the label, every block position alike", fontsize=10)
    elif not comparable:
        axes[0, 0].set_title(
            "loss: train and validation weigh block positions differently", fontsize=10
        )
    path = [r for r in val if r.get("path_tau") is not None]
    if path:  # greedy decoding replayed from the held-out responses (train/path_tau.py)
        axes[1, 1].plot(
            *_series(path, "path_tau"), "s--", label="validation, path tau", markersize=4
        )
        axes[1, 1].legend()
    axes[1, 1].set_title("acceptance length (estimated; path tau: decoding replayed)")
    _by_position(axes[1, 0], train, val)
    fig.suptitle(title or run_dir.name)
    fig.tight_layout()
    return fig


def loss_labels(run_dir: Path) -> tuple[dict[str, str], bool]:
    """The loss curves' legends ({"train": ..., "validation": ...}) and whether the two weigh a
    block's positions alike. Training minimises the objective of [objective] (D-PACE weights by
    default, maybe per-block normalised, with the serving path weighted); validation always reports
    the gamma-weighted loss, so runs compare. Read from run.toml; unknown without one."""
    try:
        cfg = tomllib.loads((run_dir / "run.toml").read_text())
    except (OSError, ValueError):
        return {
            "train": "train (the training objective)",
            "validation": "validation (gamma weights)",
        }, False
    o = cfg.get("objective", {})
    weights = {"dpace": "D-PACE weights", "gamma": "gamma weights"}[o.get("weights", "dpace")]
    parts = [weights]
    if o.get("normalise", "weight") == "anchors":
        parts.append("per block")
    if o.get("path_weight", 0.0):
        parts.append(f"serving path x{1 + o['path_weight']:g}")
    train = "train (objective: " + ", ".join(parts) + ")"
    return {"train": train, "validation": "validation (gamma weights)"}, parts == ["gamma weights"]


def _by_position(ax, train: list[dict[str, Any]], val: list[dict[str, Any]]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for records, name in ((train, "train"), (val, "validation")):
        if records:
            acc = records[-1]["acc_by_pos"]
            ax.plot(range(1, len(acc) + 1), acc, "o-", label=f"{name} (step {records[-1]['step']})")
    ax.set_xlabel("block position k (predicts anchor + k)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("accuracy by block position")


if __name__ == "__main__":
    print(save_report(sys.argv[1]))
