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

    PYTHONPATH=. python benchmarks/answer_tokens.py --turns 2 [--work DIR]

measures the earlier answers of multi-turn conversations instead: the same prompts paired into 192
two-turn conversations, both turns answered by dflash-generate (`turns = "all"`) with a copy of the
demo's target that also stops on token 10, about 2% of what it emits (it rarely stops within 96
tokens otherwise, and a cut first turn ends its conversation); the variant
`earlier_answer_ids` trains on the records as written (an earlier answer whose ids its rendering
in the second turn's prompt does not hold is context only there, and a sequence of its own:
data.earlier_answers = "apart", the default), `earlier_context` the same with it context only
(data.earlier_answers = "context"), `earlier_text` on the same records without
`earlier_answer_ids` (every earlier answer in the loss as its text re-tokenised: what precompute
did before). Real decoding is measured on the second turns (the history the target
answered them after, its own first answer in it) and on the first turns, path tau on each store.
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


def without_ids(generated: Path, out: Path, fields: tuple[str, ...] = ("answer_ids",)) -> Path:
    """The generated shards with each record's `fields` dropped (answer_ids: precompute reads
    their text)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for shard in sorted(generated.glob("u*.jsonl")):
        records = [json.loads(line) for line in shard.read_text().splitlines() if line.strip()]
        for r in records:
            for field in fields:
                r.pop(field, None)
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


def conversations_file(out: Path) -> Path:
    """The demo's training prompts paired into two-turn conversations (the first answer is the
    input's placeholder: dflash-generate replaces both)."""
    lines = [line for line in (ROOT / "data" / "tiny-train-prompts.txt").read_text().splitlines()]
    lines = [line for line in lines if line.strip()]
    out.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"pair{k}",
                    "messages": [
                        {"role": "user", "content": lines[k]},
                        {"role": "assistant", "content": "-"},
                        {"role": "user", "content": lines[k + 1]},
                    ],
                }
            )
            + "\n"
            for k in range(0, len(lines) - 1, 2)
        )
    )
    return out


def turn_prompts(generated: Path, out: Path, turn: int) -> Path:
    """dflash-eval prompts of every two-turn record: turn 2 after the history the target answered
    it after (its own first answer in it), or turn 1 alone."""
    with out.open("w") as f:
        for shard in sorted(generated.glob("u*.jsonl")):
            for line in shard.read_text().splitlines():
                r = json.loads(line) if line.strip() else {}
                if r.get("generated_turns") == 2:
                    history = r["messages"][:-1] if turn == 2 else r["messages"][:1]
                    f.write(json.dumps({"messages": history}) + "\n")
    return out


def measure(
    name: str,
    inputs: Path,
    prompts: Path | dict[str, Path],
    work: Path,
    target: Path = TARGET,
    options: tuple[str, ...] = (),
) -> dict:
    """Precompute, train, export and measure one variant -> its row (`prompts`: one file, or
    {label: file} measured in turn)."""
    d = work / name
    shutil.rmtree(d, ignore_errors=True)
    store, run, drafter = d / "store", d / "train", d / "drafter"
    stage(f"{name}: precompute", "precompute.cli", "--config", CONFIG, f"--out={store}",
          f"--data.inputs={json.dumps([str(inputs)])}", f"--target.path={target}",
          *options)  # fmt: skip
    stage(f"{name}: train", "train.cli", "--config", CONFIG, f"--store={store}", f"--out={run}")
    stage(f"{name}: export", "dflash_common.drafter.export", str(run), str(drafter), "--overwrite")
    common = [f"--target.path={target}", f"--generation.max_new_tokens={MAX_NEW}"]
    stage(f"{name}: path tau", "train.eval.cli", "--offline", f"--store={store}",
          f"--drafter={run}", "--offline.holdout_sequences=1000000",
          f"--report={d / 'offline.json'}", *common)  # fmt: skip
    sets = prompts if isinstance(prompts, dict) else {"": prompts}
    offline = json.loads((d / "offline.json").read_text())
    with Store.open(store) as opened:
        info = store_info(opened)  # what `dflash-store info` prints
    row = {"variant": name, "tokens": info["tokens"], "path_tau": offline["path_tau"],
           "responses": offline["path_sequences"]}  # fmt: skip
    for label, file in sets.items():
        report = d / f"eval{label}.json"
        stage(f"{name}: real decoding {label}", "train.eval.cli", f"--drafter={drafter}",
              f"--prompts.files={json.dumps([str(file)])}", "--generation.batch_size=64",
              f"--report={report}", *common, env=ONE_THREAD)  # fmt: skip
        real = json.loads(report.read_text())
        row |= {f"tau_emitted{label}": real["tau_emitted"], f"tau{label}": real["tau"],
                f"prompts{label}": real["num_prompts"]}  # fmt: skip
    return row


# (header, cell) of each column of the two tables
ANSWER_COLUMNS = [
    ("training answers", lambda r: r["variant"]),
    ("store tokens", lambda r: f"{r['tokens']:,}"),
    ("path tau (store)", lambda r: f"{r['path_tau']:.3f}"),
    ("real tau, emitted", lambda r: f"{r['tau_emitted']:.3f}"),
    ("path / real", lambda r: f"{r['path_tau'] / r['tau_emitted']:.3f}"),
    ("real tau", lambda r: f"{r['tau']:.3f}"),
    ("responses / prompts", lambda r: f"{r['responses']} / {r['prompts']}"),
]
TURN_COLUMNS = [
    ("earlier answers", lambda r: r["variant"]),
    ("store tokens", lambda r: f"{r['tokens']:,}"),
    ("loss tokens", lambda r: f"{r['loss_tokens']:,}"),
    ("path tau (store)", lambda r: f"{r['path_tau']:.3f}"),
    ("real tau, turn 2", lambda r: f"{r['tau-turn2']:.3f}"),
    ("real tau, turn 1", lambda r: f"{r['tau-turn1']:.3f}"),
    ("prompts", lambda r: f"{r['prompts-turn2']} + {r['prompts-turn1']}"),
]


def table(rows: list[dict], columns=ANSWER_COLUMNS) -> str:
    """A markdown table of `rows`: the first and last columns left-aligned, the rest right."""
    align = ["---"] + ["---:"] * (len(columns) - 2) + ["---"]
    cells = [[cell(r) for _, cell in columns] for r in rows]
    lines = [[head for head, _ in columns], align, *cells]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def two_turns(work: Path) -> None:
    """The earlier answers of two-turn conversations, kept as emitted or re-tokenised."""
    generated = work / "generated-2turns"
    target = work / "target-stops"  # the demo's target, stopping on token 10 too
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(TARGET, target)
    config = json.loads((target / "generation_config.json").read_text())
    stops = [config["eos_token_id"]] if isinstance(config["eos_token_id"], int) else []
    config["eos_token_id"] = stops + [10]  # ~2% of the tokens it emits: most first turns stop
    (target / "generation_config.json").write_text(json.dumps(config))
    if not (generated / "manifest.json").is_file():
        shutil.rmtree(generated, ignore_errors=True)
        inputs = conversations_file(work / "conversations.jsonl")
        stage("generate", "precompute.generate.cli", "--config", CONFIG, f"--out={generated}",
              f"--data.inputs={json.dumps([str(inputs)])}", f"--target.path={target}",
              env=ONE_THREAD)  # fmt: skip
    prompts = {
        "-turn2": turn_prompts(generated, work / "turn2.jsonl", 2),
        "-turn1": turn_prompts(generated, work / "turn1.jsonl", 1),
    }
    text = without_ids(generated, work / "generated-2turns-text", ("earlier_answer_ids",))
    rows = [
        measure("earlier_answer_ids", generated, prompts, work, target),
        measure(
            "earlier_context", generated, prompts, work, target, ("--data.earlier_answers=context",)
        ),  # fmt: skip
        measure("earlier_text", text, prompts, work, target),
    ]
    for r in rows:
        with Store.open(work / r["variant"] / "store") as opened:
            r["loss_tokens"] = int(opened.summary["response_tokens"])
    print(table(rows, TURN_COLUMNS))
    (work / "results-2turns.json").write_text(json.dumps(rows, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="answer_tokens.py", description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/answer-tokens"))
    parser.add_argument("--turns", type=int, choices=(1, 2), default=1)
    args = parser.parse_args(argv)
    work = args.work.resolve()
    build_tiny_target(TARGET, TinySpec())
    if args.turns == 2:
        return two_turns(work)
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
