"""benchmarks/quality/run.py: every variant's dflash-train command (recipe + overrides) and every
dflash-eval command parse into the stage's config, so a GPU run does not fail on a typo."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from dflash_common.config import load_config
from train.config import TrainConfig
from train.eval.config import EvalConfig

ROOT = Path(__file__).resolve().parents[2]


def _runner():
    spec = importlib.util.spec_from_file_location("quality_run", ROOT / "benchmarks" / "quality" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tiny", [False, True])
def test_every_variant_command_parses_into_a_train_config(tmp_path, tiny):
    run = _runner()
    args = run.parse(["--work", str(tmp_path), "--variants", ",".join(run.VARIANTS), "--seeds", "0,3"]
                     + (["--tiny"] if tiny else []))
    assert args.train_prompts == (5000 if not tiny else args.train_prompts)
    for variant in run.VARIANTS:
        cmd = run.train_command(args, variant, 3)
        assert cmd[1:3] == ["-m", "train.cli"]
        cfg = load_config(TrainConfig, None, cmd[3:])
        assert cfg.run.seed == 3 and cfg.run.out_dir == str(tmp_path / "runs" / variant / "seed-3")
        if not tiny:  # the recipe of the issue, but for what the variant itself changes
            recipe = {"drafter.block_size": 16, "drafter.depth": 3, "optim.epochs": 6, "optim.lr": 6e-4}
            changed = {o.split("=")[0].removeprefix("--") for o in run.VARIANTS[variant]}
            for key, value in recipe.items():
                section, field = key.split(".")
                assert key in changed or getattr(getattr(cfg, section), field) == value, (variant, key)
            assert cfg.drafter.layer_ids is None  # the store's: the DFlash rule


def test_eval_commands_parse_and_ask_for_float32_and_lossless(tmp_path):
    run = _runner()
    args = run.parse(["--work", str(tmp_path)])
    cmds = run.eval_commands(args, tmp_path / "runs" / "baseline" / "seed-0")
    shortcuts = {"--drafter": "--drafter.path", "--report": "--report.path", "--store": "--offline.store"}
    for name, cmd in cmds.items():
        argv = [a for a in cmd[3:] if a != "--offline"]
        argv = [f"{shortcuts[a]}={b}" for a, b in zip(argv[::1], argv[1:]) if a in shortcuts] + \
               [a for i, a in enumerate(argv) if a.startswith("--") and a not in shortcuts and "=" in a]
        cfg = load_config(EvalConfig, None, argv)
        assert cfg.generation.max_new_tokens == args.max_new_tokens
    real = load_config(EvalConfig, None, [a for a in cmds["eval"][3:] if "=" in a])
    assert real.target.dtype == "float32" and real.check.lossless == "error"


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        _runner().parse(["--work", str(tmp_path), "--variants", "nope"])


def test_the_rich_regime_trains_about_one_pass_at_the_small_regimes_steps(tmp_path):
    """rich: the same 450 steps of 16K tokens (max_steps), at most 2 epochs over ~5x the prompts."""
    run = _runner()
    args = run.parse(["--work", str(tmp_path), "--regime", "rich", "--variants", "dpace", "--seeds", "0"])
    assert args.train_prompts == 24000 and run.settings(args)["regime"] == "rich"
    cfg = load_config(TrainConfig, None, run.train_command(args, "dpace", 0)[3:])
    assert (cfg.optim.max_steps, cfg.optim.epochs, cfg.data.batch_tokens) == (450, 2, 16384)
    small = run.parse(["--work", str(tmp_path), "--variants", "dpace", "--seeds", "0"])
    assert load_config(TrainConfig, None, run.train_command(small, "dpace", 0)[3:]).optim.max_steps is None


def test_heldout_answers_and_the_table_say_how_dflash_eval_decodes(tmp_path):
    """The held-out answers are made at the batch size dflash-eval picks on the stage's device (one
    at a time on a CPU), and the table says where dflash-eval decoded."""
    run = _runner()
    assert run.heldout_batch_size(run.parse(["--work", str(tmp_path), "--device", "cpu"])) == 1
    assert run.heldout_batch_size(run.parse(["--work", str(tmp_path), "--tiny"])) == 1
    batched = run._decoded_on({"device": "cuda:0", "batch_size": 256})
    assert batched == "cuda:0, batches of up to 256"
    assert run._decoded_on({"device": "cpu", "batch_size": 1}) == "cpu, one at a time"
    assert run._decoded_on({}) is None
