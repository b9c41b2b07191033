"""What every dflash command line does alike: options are spelt out in full (no prefix stands for
an option), a mistyped option or config key gets the closest real one, --help shows examples, and
an output on a read-only filesystem or in an immutable directory is refused in one sentence before
any work, dry runs included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
MODULES = {"dflash-generate": "precompute.generate.cli", "dflash-precompute": "precompute.cli",
           "dflash-store": "dflash_common.store.cli", "dflash-train": "train.cli",
           "dflash-export": "dflash_common.drafter.export", "dflash-eval": "train.eval.cli"}


def _main(cli: str):
    import importlib

    return importlib.import_module(MODULES[cli]).main


def _exits_2(main, argv, capsys) -> str:
    """main(argv) ends with exit code 2, without a traceback; -> stderr."""
    with pytest.raises(SystemExit) as caught:
        main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "Traceback" not in err, err
    return err


# (CLI, argv, what stderr says): a prefix of an option is refused, naming the option it meant
ABBREVIATED = [
    ("dflash-export", ["run", "out", "--overwrit"],
     "unrecognized arguments: --overwrit (did you mean --overwrite?)"),
    ("dflash-train", ["--stor", "S", "--out", "R"],
     "unrecognized argument '--stor' (did you mean --store?)"),
    ("dflash-precompute", ["--dry"], "unrecognized argument '--dry' (did you mean --dry-run?)"),
    ("dflash-generate", ["--dry"], "unrecognized argument '--dry' (did you mean --dry-run?)"),
    ("dflash-eval", ["--offlin"], "unrecognized argument '--offlin' (did you mean --offline?)"),
    ("dflash-store", ["info", "S", "--jso"],
     "unrecognized arguments: --jso (did you mean --json?)"),
]
# mistyped switches, options and config sections
MISTYPED = [
    ("dflash-precompute", ["--confg", TINY],
     "unrecognized argument '--confg' (did you mean --config?)"),
    ("dflash-precompute", ["--dryrun"],
     "unrecognized argument '--dryrun' (did you mean --dry-run?)"),
    ("dflash-generate", ["--dryrun"], "unrecognized argument '--dryrun' (did you mean --dry-run?)"),
    ("dflash-train", ["--confg=x.toml"],
     "unrecognized argument '--confg=x.toml' (did you mean --config?)"),
    ("dflash-train", ["--optm.lr=1e-3"],
     "Unknown config key 'optm' in --optm.lr (did you mean --optim.lr?)"),
    ("dflash-train", ["--optim.lrr", "1e-3"],
     "Unknown config key 'optim.lrr' in --optim.lrr (did you mean --optim.lr?)"),
    ("dflash-eval", ["--generaton.block_size=8"], "(did you mean --generation.block_size?)"),
    ("dflash-export", ["run", "out", "--dtyp", "fp32"], "(did you mean --dtype?)"),
]


@pytest.mark.parametrize("cli, argv, says", ABBREVIATED + MISTYPED)
def test_an_abbreviated_or_mistyped_option_is_refused_naming_the_closest_one(cli, argv, says,
                                                                             capsys):
    err = _exits_2(_main(cli), argv, capsys)
    assert says in err, err


def test_every_cli_shows_examples_in_its_help_and_generate_its_dry_run_in_the_usage_line():
    for cli, module in MODULES.items():
        shown = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=ENV,
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        examples = [line for line in lines if line.lstrip().startswith(f"{cli} ")]
        assert len(examples) >= 2, (cli, shown.stdout[:1500])
        if cli == "dflash-generate":
            assert "[--dry-run]" in shown.stdout.split("\n\n")[0]


# ---------------------------------------------------------------- outputs that cannot be written


def _cannot_write(err: str, what: str, path: Path) -> None:
    assert err.count("\n") == 1 and f"error: {what} {path} cannot be written (" in err, err


def test_precompute_refuses_a_store_it_cannot_write_before_any_work(unwritable_dir, tiny_target,
                                                                   capsys):
    from precompute.cli import main

    store = unwritable_dir / "store"
    inputs = json.dumps([str(ROOT / "data" / "tiny-train.jsonl")])
    args = ["--config", TINY, "--out", str(store), f"--target.path={tiny_target}",
            f"--data.inputs={inputs}", "--run.progress=false"]
    for extra in ([], ["--dry-run"]):  # the dry run's plan must not call the place "enough"
        _cannot_write(_exits_2(main, args + extra, capsys), "store.path", store)
        assert capsys.readouterr().out == ""  # refused before the plan


def test_generate_refuses_an_output_it_cannot_write_before_any_work(unwritable_dir, tiny_target,
                                                                   capsys):
    from precompute.generate.cli import main

    out = unwritable_dir / "generated"
    inputs = json.dumps([str(ROOT / "data" / "tiny-train-prompts.txt")])
    args = ["--config", TINY, "--out", str(out), f"--target.path={tiny_target}",
            f"--data.inputs={inputs}", "--run.progress=false"]
    for extra in ([], ["--dry-run"]):
        _cannot_write(_exits_2(main, args + extra, capsys), "output.dir", out)


def test_train_refuses_a_run_directory_it_cannot_write_before_any_work(unwritable_dir, tmp_path,
                                                                      capsys):
    from train.cli import main

    run = unwritable_dir / "run"
    argv = ["--config", TINY, "--store", str(tmp_path / "no-store"), "--out", str(run)]
    _cannot_write(_exits_2(main, argv, capsys), "run.out_dir", run)  # before the store is opened


def _drafter_dir(tiny_target: Path, where: Path) -> Path:
    from dflash_common.drafter.config import DrafterConfig
    from dflash_common.drafter.export import save_drafter
    from dflash_common.drafter.model import DFlashDrafter

    target = json.loads((tiny_target / "config.json").read_text())
    cfg = DrafterConfig.from_target(target, mask_token_id=259, depth=1, block_size=4)
    return save_drafter(DFlashDrafter(cfg), where)


def test_export_refuses_an_out_dir_it_cannot_write(unwritable_dir, tiny_target, tmp_path, capsys):
    from dflash_common.drafter.export import main

    source = _drafter_dir(tiny_target, tmp_path / "drafter")
    out = unwritable_dir / "export"
    _cannot_write(_exits_2(main, [str(source), str(out)], capsys), "OUT_DIR", out)


def test_eval_refuses_a_report_it_cannot_write_before_the_evaluation(unwritable_dir, tiny_target,
                                                                   tmp_path, capsys, monkeypatch):
    import train.eval.cli as cli

    evaluations = []
    monkeypatch.setattr(cli, "run", evaluations.append)  # stands for the whole evaluation
    source = _drafter_dir(tiny_target, tmp_path / "drafter")
    base = ["--config", TINY, f"--target.path={tiny_target}", "--drafter", str(source)]
    report = unwritable_dir / "eval.json"
    err = _exits_2(cli.main, base + ["--report", str(report)], capsys)
    _cannot_write(err, "report.path", report)
    cache = unwritable_dir / "baselines"
    err = _exits_2(cli.main, base + [f"--check.baseline_cache={cache}"], capsys)
    _cannot_write(err, "check.baseline_cache", cache)
    assert evaluations == []
