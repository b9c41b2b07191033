"""benchmarks/quality/run.py: every variant's dflash-train command (recipe + overrides) and every
dflash-eval command parse into the stage's config, so a GPU run does not fail on a typo."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dflash_common.config import load_config
from precompute.config import PrecomputeConfig
from train.config import TrainConfig
from train.eval_config import EvalConfig

ROOT = Path(__file__).resolve().parents[2]


def _runner():
    spec = importlib.util.spec_from_file_location("quality_run", ROOT / "benchmarks" / "quality" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tiny", [False, True])
def test_every_variant_command_parses_into_a_train_config(tmp_path, tiny):
    run = _runner()
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"num_hidden_layers": 8}))
    args = run.parse(["--work", str(tmp_path), "--variants", ",".join(run.VARIANTS), "--seeds", "0,3"]
                     + (["--tiny"] if tiny else []))
    for variant in run.VARIANTS:
        cmd = run.train_command(args, variant, 3)
        assert cmd[1:3] == ["-m", "train.cli"]
        cfg = load_config(TrainConfig, None, cmd[3:])
        assert cfg.run.seed == 3 and cfg.run.out_dir == str(tmp_path / "runs" / variant / "seed-3")
        spec = run.STORES.get(variant, run.StoreSpec())
        assert cfg.data.stores == [str(tmp_path / "stores" / spec.name("train"))]
        if spec.all_layers:  # the drafter reads every layer its store captured
            assert cfg.drafter.layer_ids == list(range(8))
            continue
        if not tiny:  # the recipe of the issue, but for what the variant itself changes
            recipe = {"drafter.block_size": 16, "drafter.depth": 3, "optim.epochs": 6, "optim.lr": 6e-4}
            changed = {o.split("=")[0].removeprefix("--") for o in run.VARIANTS[variant]}
            for key, value in recipe.items():
                section, field = key.split(".")
                assert key in changed or getattr(getattr(cfg, section), field) == value, (variant, key)
            assert cfg.drafter.layer_ids is None  # the store's: the DFlash rule


def test_variants_of_other_stores_train_and_are_evaluated_on_their_own_stores(tmp_path):
    run = _runner()
    args = run.parse(["--work", str(tmp_path), "--variants", "baseline,q4,q4+all_layers,all_layers,fp8"])
    assert [s.name("train") for s in run.variant_stores(args)] == [
        "train-q4_hadamard", "train-q4_hadamard-all", "train-all", "train-fp8_e4m3"]
    stores = tmp_path / "stores"
    for variant, train, heldout in (("baseline", "train", "heldout"), ("q4", "train-q4_hadamard", "heldout"),
                                    ("q4+all_layers", "train-q4_hadamard-all", "heldout-all")):
        cmds = run.eval_commands(args, tmp_path / "runs" / variant / "seed-0")
        assert cmds["offline_train"][cmds["offline_train"].index("--store") + 1] == str(stores / train)
        assert cmds["offline_heldout"][cmds["offline_heldout"].index("--store") + 1] == str(stores / heldout)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 4}}))
    spec = run.STORES["q4+all_layers"]
    cmd = run.precompute_command(args, tmp_path / "data" / "train.jsonl", stores / spec.name("train"), spec)
    assert cmd[1:3] == ["-m", "precompute.cli"]
    cfg = load_config(PrecomputeConfig, None, [a for a in cmd[3:] if a.startswith("--") and "=" in a])
    assert cfg.store.dtype == "q4_hadamard" and cfg.target.layer_ids == [0, 1, 2, 3]
    assert not cfg.store.final_state  # only stores/train keeps final states (soft-target variants)


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
