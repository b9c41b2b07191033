"""Training answers as the target emitted them (dflash-generate's `answer_ids`) against the same
answers' text re-tokenised, on the demo's tiny target, through the real CLIs:

    PYTHONPATH=. python benchmarks/answer_tokens.py [--work DIR]

dflash-generate answers the demo's 384 training prompts once (configs/tiny.toml); a copy of its
shards without `answer_ids` is the text variant (what precompute read before it kept the ids). Each
variant is precomputed, trained and exported with the demo's config, then measured two ways on the
same 384 prompts, at most 64 new tokens: path tau, greedy decoding replayed on the store
(`dflash-eval --offline`, every sequence held out), and real speculative decoding
(`dflash-eval`, batched, lossless; its `tau_emitted` is the count path tau replays). When the store
holds what the target emits, the two agree; the table shows how far apart they are and what the
drafter reaches. The demo is deterministic on one machine: one run per variant.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_common.cli import ArgumentParser  # noqa: E402
from dflash_common.demo import ONE_THREAD, TARGET, stage  # noqa: E402
from dflash_common.store import Store  # noqa: E402
from dflash_common.store.verify import store_info  # noqa: E402
from dflash_common.tiny import TinySpec, build_tiny_target  # noqa: E402

CONFIG = "configs/tiny.toml"
MAX_NEW = 64


def without_ids(generated: Path, out: Path) -> Path:
    """The generated shards with each record's answer_ids dropped: precompute reads their text."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for shard in sorted(generated.glob("u*.jsonl")):
        records = [json.loads(line) for line in shard.read_text().splitlines() if line.strip()]
        for r in records:
            r.pop("answer_ids", None)
        (out / shard.name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def prompts_file(out: Path) -> Path:
    """The demo's training prompts as message records, for dflash-eval."""
    lines = (ROOT / "data" / "tiny-train-prompts.txt").read_text().splitlines()
    out.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": line}]}) + "\n"
            for line in lines
            if line.strip()
        )
    )
    return out


def measure(name: str, inputs: Path, prompts: Path, work: Path) -> dict:
    """Precompute, train, export and measure one variant -> its row."""
    d = work / name
    shutil.rmtree(d, ignore_errors=True)
    store, run, drafter = d / "store", d / "train", d / "drafter"
    stage(f"{name}: precompute", "precompute.cli", "--config", CONFIG, f"--out={store}",
          f"--data.inputs={json.dumps([str(inputs)])}")  # fmt: skip
    stage(f"{name}: train", "train.cli", "--config", CONFIG, f"--store={store}", f"--out={run}")
    stage(f"{name}: export", "dflash_common.drafter.export", str(run), str(drafter), "--overwrite")
    common = [f"--target.path={TARGET}", f"--generation.max_new_tokens={MAX_NEW}"]
    stage(f"{name}: path tau", "train.eval.cli", "--offline", f"--store={store}",
          f"--drafter={run}", "--offline.holdout_sequences=1000000",
          f"--report={d / 'offline.json'}", *common)  # fmt: skip
    stage(f"{name}: real decoding", "train.eval.cli", f"--drafter={drafter}",
          f"--prompts.files={json.dumps([str(prompts)])}", "--generation.batch_size=64",
          f"--report={d / 'eval.json'}", *common, env=ONE_THREAD)  # fmt: skip
    offline = json.loads((d / "offline.json").read_text())
    real = json.loads((d / "eval.json").read_text())
    with Store.open(store) as opened:
        tokens = store_info(opened)["tokens"]  # what `dflash-store info` prints
    return {
        "variant": name,
        "tokens": tokens,
        "path_tau": offline["path_tau"],
        "tau_emitted": real["tau_emitted"],
        "tau": real["tau"],
        "responses": offline["path_sequences"],
        "prompts": real["num_prompts"],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| training answers | store tokens | path tau (store) | real tau, emitted | path / real "
        "| real tau | responses / prompts |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['tokens']:,} | {r['path_tau']:.3f} | {r['tau_emitted']:.3f} "
            f"| {r['path_tau'] / r['tau_emitted']:.3f} | {r['tau']:.3f} "
            f"| {r['responses']} / {r['prompts']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="answer_tokens.py", description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/answer-tokens"))
    work = parser.parse_args(argv).work.resolve()
    build_tiny_target(TARGET, TinySpec())
    generated = work / "generated"
    if not (generated / "manifest.json").is_file():
        shutil.rmtree(generated, ignore_errors=True)
        stage("generate", "precompute.generate.cli", "--config", CONFIG, f"--out={generated}",
              env=ONE_THREAD)  # fmt: skip
    prompts = prompts_file(work / "prompts.jsonl")
    rows = [
        measure("answer_ids", generated, prompts, work),
        measure("text", without_ids(generated, work / "generated-text"), prompts, work),
    ]
    print(table(rows))
    (work / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
