"""`make demo`: the whole product on the embedded tiny target, on a CPU, in a few minutes.

    target (built from a fixed seed) -> dflash-generate (the target answers the training prompts)
    -> dflash-precompute -> store -> dflash-store verify
    -> dflash-train -> dflash-export -> dflash-eval (real speculative decoding, lossless check)

Each stage runs as its own process through its CLI, with the shipped configs in configs/, exactly as
a user would run it; this module only orders them and prints where everything is. Outputs go to
demo/ (or --out DIR; the target to .cache/tiny-target); a rerun starts the stages afresh but reuses
the target.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dflash_common.cli import ArgumentParser
from dflash_common.tiny import TinySpec, build_tiny_target

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / ".cache" / "tiny-target"  # where configs/tiny.toml looks for it
# Decoding the tiny target is thousands of tiny ops: an intra-op thread pool spanning a small shared
# CPU stalls on them (minutes instead of seconds), one thread does not.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def stage(title: str, *args: str, env: dict[str, str] | None = None) -> float:
    """Run one CLI (`python -m module args...`) from the repository root; stop the demo if it
    fails."""
    print(f"\n=== {title}: {' '.join(args)}", flush=True)
    started = time.perf_counter()
    if subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env).returncode != 0:
        sys.exit(f"demo: the stage '{title}' failed (see above)")
    return time.perf_counter() - started


def last_records(run: Path) -> tuple[dict, dict]:
    """The last training and the last validation record of a run's metrics.jsonl."""
    records = [
        json.loads(line)
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    last = {kind: [r for r in records if r.get("kind") == kind][-1:] for kind in ("train", "val")}
    return (last["train"] or [{}])[0], (last["val"] or [{}])[0]


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="make demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "demo", help="where the demo writes (default: demo/)"
    )
    out = parser.parse_args(argv).out.resolve()
    store, run, drafter, report_path = (
        out / "store",
        out / "train",
        out / "drafter",
        out / "eval.json",
    )
    generated = out / "generated"
    started = time.perf_counter()
    build_tiny_target(TARGET, TinySpec())
    for old in (generated, store, run, drafter):
        shutil.rmtree(old, ignore_errors=True)
    times = {
        "generate": stage(
            "generate",
            "precompute.generate.cli",
            "--config",
            "configs/tiny.toml",
            f"--out={generated}",
            env=ONE_THREAD,
        ),
        "precompute": stage(
            "precompute",
            "precompute.cli",
            "--config",
            "configs/tiny.toml",
            f"--out={store}",
            f"--data.inputs={json.dumps([str(generated)])}",
        ),
        "verify": stage("verify", "dflash_common.store.cli", "verify", str(store)),
        "train": stage(
            "train",
            "train.cli",
            "--config",
            "configs/tiny.toml",
            f"--store={store}",
            f"--out={run}",
        ),
        "export": stage(
            "export", "dflash_common.drafter.export", str(run), str(drafter), "--overwrite"
        ),
        "eval": stage(
            "eval",
            "train.eval.cli",
            "--config",
            "configs/tiny.toml",
            f"--drafter={drafter}",
            f"--report={report_path}",
        ),
    }
    info = json.loads(
        subprocess.run(
            [sys.executable, "-m", "dflash_common.store.cli", "info", str(store), "--json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    train, val = last_records(run)
    report = json.loads(report_path.read_text())
    gen = json.loads((generated / "manifest.json").read_text())
    paths = {
        "generated": generated,
        "store": store,
        "run": run,
        "drafter": drafter,
        "report": report_path,
    }
    summary(paths, gen, info, train, val, report, times, time.perf_counter() - started)


def rel(path: Path) -> Path:
    """A path as short as it can be said from the repository root (where `make demo` runs)."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def summary(
    paths: dict[str, Path],
    gen: dict,
    info: dict,
    train: dict,
    val: dict,
    report: dict,
    times: dict,
    total: float,
) -> None:
    store, run, drafter, report_path = (
        paths["store"],
        paths["run"],
        paths["drafter"],
        paths["report"],
    )
    generated = paths["generated"]
    print(
        "\n=== dflash demo: done in %.0f s (%s)"
        % (total, ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    )
    print(f"  target        {rel(TARGET)}  (tiny Qwen3, 8 layers, hidden 64, built from seed 0)")
    reasons = ", ".join(f"{k} {v}" for k, v in gen["finish_reasons"].items())
    print(
        f"  generated     {rel(generated)}  "
        f"{gen['counts']['conversations']} answers of the target, "
        f"{gen['counts']['generated_tokens']:,} tokens ({reasons})"
    )
    print(
        f"  store         {rel(store)}  {info['tokens']:,} tokens in {info['shards']} shards, "
        f"{info['bytes_per_token']:,.1f} bytes/token on disk, layers {info['layer_ids']}, "
        f"{info['dtype']}"
    )
    nan = float("nan")
    print(
        f"  training run  {rel(run)}  final cross-entropy {train.get('ce', nan):.3f}, "
        f"accuracy {train.get('acc', nan):.3f}; held out: cross-entropy {val.get('ce', nan):.3f}, "
        f"accuracy {val.get('acc', nan):.3f}, estimated tau {val.get('tau', nan):.2f}"
    )
    print(
        f"  picture       {rel(run / 'report.png')}  "
        "(loss, accuracy by block position, tau over steps)"
    )
    print(
        f"  drafter       {rel(drafter)}  "
        "(config.json + model.safetensors, the layout SGLang and vLLM load)"
    )
    lossless = report["lossless"]["ok"]
    print(
        f"  eval          {rel(report_path)}  tau {report['tau']:.2f} "
        f"(block {report['block_size']}) over {report['num_prompts']} prompts "
        f"by real speculative decoding; lossless: {'yes' if lossless else 'NO'}"
    )


if __name__ == "__main__":
    main()
