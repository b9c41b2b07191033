"""The dflash-precompute command line: the shipped tiny config end to end (and the trainer's tiny
config reading its store), --dry-run, the disk check, and user errors as one sentence with exit
2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_common.store import Store
from dflash_common.store.verify import verify_store
from precompute import plan as P
from precompute.cli import main, parse

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")


def _tiny_args(tiny_target, out, *extra):
    return [
        "--config",
        TINY,
        "--out",
        str(out),
        f"--target.path={tiny_target}",
        f"--data.inputs={json.dumps([str(ROOT / 'data' / 'tiny-train.jsonl')])}",
        "--run.progress=false",
        *extra,
    ]


def test_the_tiny_config_writes_a_store_the_tiny_trainer_reads(tiny_target, tmp_path, capsys):
    from train.cli import parse as parse_train
    from train.config import TrainConfig
    from train.loop import run as train

    store = tmp_path / "store"
    assert (
        main(_tiny_args(tiny_target, store)) is None
    )  # a console script's exit code is main()'s result
    out = capsys.readouterr().out
    assert "plan: 384 input records -> 24 work units" in out and "done: 383 samples" in out
    s = Store.open(store)
    assert (
        len(s.shards) == 24
        and s.manifest.layer_ids == (1, 2, 3, 4, 5)
        and verify_store(s).bad == {}
    )
    assert s.summary["skips"]["counts"] == {"too_few_response_tokens": 1}
    _one_figure_one_value(out, store)
    cfg: TrainConfig = parse_train(
        [
            "--config",
            str(ROOT / "configs" / "tiny.toml"),
            "--store",
            str(store),
            "--out",
            str(tmp_path / "train"),
            f"--run.target={tiny_target}",
            "--optim.max_steps=2",
            "--log.progress=false",
            "--log.tensorboard=false",
        ]
    )
    run_dir = train(cfg)
    assert (Path(run_dir) / "drafter" / "model.safetensors").is_file()


def _one_figure_one_value(out: str, store: Path) -> None:
    """The plan's sizes are the store's: the arrays (what a read returns) in the same figure in the
    plan and in `dflash-store info`, which names its other size (files on disk, metadata included)
    apart, and precompute's last line gives that size too; binary units only; no compression ratio
    for codec none."""
    import re

    from dflash_common.store.cli import format_info
    from dflash_common.store.verify import store_info

    info_text = format_info(store_info(Store.open(store)))
    planned = re.search(r"arrays before compression: ([\d.,]+ [KMG]iB)", out).group(1)
    assert re.search(
        rf"arrays \(decoded\)\s+{re.escape(planned)}: 645 array bytes/token \+ 8 per sequence",
        info_text,
    ), (planned, info_text)
    assert "645 array bytes/token (5 x 2 x 64 + 5 for id and mask) + 8 per sequence" in out
    disk = re.search(
        r"on disk\s+([\d.,]+ [KMG]iB) \(([\d,]+ B), [\d.,]+ bytes/token\), "
        r"incl\. shard indexes",
        info_text,
    )
    assert disk, info_text
    assert f"{disk.group(1)} on disk ({disk.group(2)}, as dflash-store info counts it)" in out, out
    assert "compression" not in info_text  # codec none
    assert not re.search(r"\d (KB|MB|GB|TB)\b", out + info_text)


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_target, tmp_path, capsys):
    main(_tiny_args(tiny_target, tmp_path / "store", "--dry-run"))
    out = capsys.readouterr().out
    assert (
        "tokens after templating: 57,471" in out
        and "645 array bytes/token" in out
        and "free space" in out
    )
    assert (
        "done:" not in out and sorted(tmp_path.iterdir()) == []
    )  # no store, no token cache, no run record
    main(
        _tiny_args(tiny_target, tmp_path / "store", "--dry-run", "--run.tokenize_workers=1")
    )  # the pool too
    assert (
        "tokens after templating: 57,471" in capsys.readouterr().out
        and sorted(tmp_path.iterdir()) == []
    )
    assert (
        parse(["--config", TINY, "--dry-run"]).run.dry_run
        and parse(["--config", TINY, "--force"]).run.force
    )


def test_the_plan_of_a_q4_store_counts_its_bytes(tiny_target, tmp_path, capsys):
    main(_tiny_args(tiny_target, tmp_path / "store", "--dry-run", "--store.dtype=q4_hadamard"))
    out = capsys.readouterr().out
    # per layer: 32 bytes of 4-bit codes + 4 group scale
    # bytes + a float32 token scale (0.31x of 645 here)
    assert "205 array bytes/token (5 x (36 + 4) + 5 for id and mask) + 8 per sequence" in out, out


def test_q4_on_a_hidden_size_of_no_whole_groups_is_one_sentence(tmp_path, capsys):
    from dflash_common.tiny import TinySpec, build_tiny_target

    target = build_tiny_target(tmp_path / "h40", TinySpec(hidden_size=40, head_dim=10))
    with pytest.raises(SystemExit) as caught:
        main(_tiny_args(target, tmp_path / "store", "--dry-run", "--store.dtype=q4_hadamard"))
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1, err
    assert (
        "q4_hadamard needs a hidden size that is a multiple of 16, not 40; choose bf16 or fp8_e4m3"
        in err
    )


def test_a_disk_too_small_is_refused_in_one_sentence(tiny_target, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(P, "free_space", lambda path: 1_000_000)
    with pytest.raises(SystemExit) as caught:
        main(_tiny_args(tiny_target, tmp_path / "store"))
    err = capsys.readouterr().err
    assert (
        caught.value.code == 2
        and err.count("\n") == 1
        and "--run.force=true" in err
        and "Traceback" not in err
    )
    assert not (tmp_path / "store").exists()
    main(_tiny_args(tiny_target, tmp_path / "store", "--force", "--dry-run"))  # forced: goes on


def test_a_refused_run_leaves_nothing_it_created(tiny_target, tmp_path, capsys, monkeypatch):
    """Refused after the plan (a disk too small) or before it (a directory holding other files): no
    lock file in the user's directory, no token cache beside it, no store; the user's files stay."""
    monkeypatch.setattr(P, "free_space", lambda path: 1_000_000)
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir()
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep")
    for out, says in [
        (mine, "--run.force=true"),
        (tmp_path / "new", "--run.force=true"),
        (theirs, "is a non-empty directory that is not a dflash store"),
    ]:
        with pytest.raises(SystemExit) as caught:
            main(_tiny_args(tiny_target, out))
        err = capsys.readouterr().err
        assert caught.value.code == 2 and says in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "theirs"]  # no <dir>.tokens/
    assert list(mine.iterdir()) == [] and [p.name for p in theirs.iterdir()] == ["notes.txt"]
    cache = tmp_path / "cache"
    cache.mkdir()  # run.cache_dir given: only what this run made in it goes
    with pytest.raises(SystemExit):
        main(_tiny_args(tiny_target, mine, f"--run.cache_dir={cache}"))
    assert list(cache.iterdir()) == [] and list(mine.iterdir()) == []


def test_out_naming_a_file_is_one_sentence(tiny_target, tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("keep")
    cases = [
        (file, f"store.path {file} is a file, not a directory; pass --out a new directory"),
        (file / "s", f"store.path {file / 's'} cannot be created: {file} is a file;"),
    ]
    for out, says in cases:
        for extra in ([], ["--dry-run"]):
            with pytest.raises(SystemExit) as caught:
                main(_tiny_args(tiny_target, out, *extra))
            err = capsys.readouterr().err
            assert caught.value.code == 2 and err.count("\n") == 1 and says in err, err
    assert file.read_text() == "keep" and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_missing_target_says_how_to_build_the_tiny_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(_tiny_args(tmp_path / "nowhere", tmp_path / "store"))
    err = capsys.readouterr().err
    assert caught.value.code == 2 and f"python -m dflash_common.tiny {tmp_path / 'nowhere'}" in err


def test_a_store_made_with_other_settings_is_refused_before_any_work(tiny_target, tmp_path, capsys):
    records = (ROOT / "data" / "tiny-train.jsonl").read_text().splitlines(keepends=True)[:8]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(records))
    args = [
        "--config",
        TINY,
        "--out",
        str(tmp_path / "store"),
        f"--target.path={tiny_target}",
        f"--data.inputs={json.dumps([str(data)])}",
        "--run.progress=false",
    ]
    main(args)
    capsys.readouterr()
    with pytest.raises(SystemExit) as caught:
        main(args + ["--target.layer_ids=1,3"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "layer_ids" in err and "use a new store path" in err


def test_the_tiny_target_builder_makes_the_fixtures_target(tiny_target, tmp_path, capsys):
    from dflash_common.tiny import main as build

    build([str(tmp_path / "t")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "t")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "t" / name).read_bytes() == (tiny_target / name).read_bytes()


def test_help_lists_the_flags_and_every_field():
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    shown = subprocess.run(
        [sys.executable, "-m", "precompute.cli", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0
    for key in (
        "--out",
        "--dry-run",
        "--force",
        "--run.samples_per_unit",
        "--store.dtype",
        "--run.queue_depth",
    ):
        assert key in shown.stdout
    usage = shown.stdout.split("\n\n")[0]  # argparse's `usage: dflash-precompute [...]` lines
    assert (
        usage.startswith("usage: dflash-precompute")
        and "[--dry-run]" in usage
        and "[--force]" in usage
    )


def test_no_progress_frames_when_stderr_is_not_a_terminal(tiny_target, tmp_path, capsys):
    """CI, `| tee`, nohup: precompute, verify and train
    (their bars on) write lines, never bar frames."""
    from dflash_common.store.cli import main as store_main
    from train.cli import main as train_main

    records = (ROOT / "data" / "tiny-train.jsonl").read_text().splitlines(keepends=True)[:16]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(records))
    store = tmp_path / "store"
    main(
        [
            "--config",
            TINY,
            "--out",
            str(store),
            f"--target.path={tiny_target}",
            f"--data.inputs={json.dumps([str(data)])}",
            "--run.progress=true",
        ]
    )
    assert store_main(["verify", str(store)]) == 0
    train_main(
        [
            "--config",
            TINY,
            "--store",
            str(store),
            "--out",
            str(tmp_path / "train"),
            f"--run.target={tiny_target}",
            "--optim.max_steps=3",
            "--log.progress=true",
            "--log.every_steps=1",
            "--log.tensorboard=false",
            "--data.holdout_sequences=2",
        ]
    )
    captured = capsys.readouterr()
    for text in (captured.err, captured.out):
        assert (
            "\r" not in text
            and "sample/s" not in text
            and "step/s" not in text
            and "shard/s" not in text
        )
    assert (
        "done: 16 samples" in captured.out
        and "OK" in captured.err
        and "done: 3 steps" in captured.err
    )


def test_a_q4_store_that_lost_shards_is_refilled_to_the_same_bytes(tiny_target, tmp_path, capsys):
    """Resume holds for q4_hadamard: a rerun of the command writes only the missing shards, bit for
    bit those of the first run (the encoding is deterministic), and the store verifies."""
    import shutil

    from precompute_helpers import cli_args, demo_inputs, published, store_files

    inputs, store = demo_inputs(tmp_path), tmp_path / "store"
    main(cli_args(tiny_target, inputs, store, "q4_hadamard"))
    whole = store_files(store)
    lost = published(store)[3:5]
    for name in lost:
        shutil.rmtree(store / "shards" / name)
    main(cli_args(tiny_target, inputs, store, "q4_hadamard"))
    capsys.readouterr()
    s = Store.open(store)
    assert store_files(store) == whole and s.summary["runs"][-1]["units_written"] == len(lost) == 2
    assert s.manifest.format_version == 2 and verify_store(s).ok
