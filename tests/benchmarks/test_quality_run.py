"""benchmarks/quality/run.py: every variant's dflash-train command (recipe + overrides) and every
dflash-eval command parse into the stage's config, so a GPU run does not fail on a typo."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from dflash_common.config import load_config
from precompute.config import PrecomputeConfig
from train.config import TrainConfig
from train.eval.config import EvalConfig

ROOT = Path(__file__).resolve().parents[2]


def _runner():
    spec = importlib.util.spec_from_file_location(
        "quality_run", ROOT / "benchmarks" / "quality" / "run.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tiny", [False, True])
def test_every_variant_command_parses_into_a_train_config(tmp_path, tiny):
    run = _runner()
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"num_hidden_layers": 8}))
    args = run.parse(
        ["--work", str(tmp_path), "--variants", ",".join(run.VARIANTS), "--seeds", "0,3"]
        + (["--tiny"] if tiny else [])
    )
    assert args.train_prompts == (5000 if not tiny else args.train_prompts)
    for variant in run.VARIANTS:
        cmd = run.train_command(args, variant, 3)
        assert cmd[1:3] == ["-m", "train.cli"]
        cfg = load_config(TrainConfig, None, cmd[3:])
        assert cfg.run.seed == 3 and cfg.run.out_dir == str(tmp_path / "runs" / variant / "seed-3")
        spec = run.store_spec(args, variant)
        assert cfg.data.stores == [str(tmp_path / "stores" / spec.name("train"))]
        if spec.all_layers:  # the drafter reads every layer its store captured
            assert cfg.drafter.layer_ids == list(range(8))
            continue
        if not tiny:  # the recipe of the issue, but for what the variant itself changes
            recipe = {
                "drafter.block_size": 16,
                "drafter.depth": 3,
                "optim.epochs": 6,
                "optim.lr": 6e-4,
            }
            changed = {o.split("=")[0].removeprefix("--") for o in run.VARIANTS[variant]}
            for key, value in recipe.items():
                section, field = key.split(".")
                assert key in changed or getattr(getattr(cfg, section), field) == value, (
                    variant,
                    key,
                )
            assert cfg.drafter.layer_ids is None  # the store's: the DFlash rule


def test_variants_of_other_stores_train_and_are_evaluated_on_their_own_stores(tmp_path):
    run = _runner()
    args = run.parse(
        ["--work", str(tmp_path), "--variants", "baseline,q4,q4+all_layers,all_layers,fp8"]
    )
    assert [s.name("train") for s in run.variant_stores(args)] == [
        "train-q4_hadamard",
        "train-q4_hadamard-all",
        "train-all",
        "train-fp8_e4m3",
    ]
    stores = tmp_path / "stores"
    for variant, train, heldout in (
        ("baseline", "train", "heldout"),
        ("q4", "train-q4_hadamard", "heldout"),
        ("q4+all_layers", "train-q4_hadamard-all", "heldout-all"),
    ):
        cmds = run.eval_commands(args, tmp_path / "runs" / variant / "seed-0")
        assert cmds["offline_train"][cmds["offline_train"].index("--store") + 1] == str(
            stores / train
        )
        assert cmds["offline_heldout"][cmds["offline_heldout"].index("--store") + 1] == str(
            stores / heldout
        )
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(
        json.dumps({"text_config": {"num_hidden_layers": 4}})
    )
    spec = run.STORES["q4+all_layers"]
    cmd = run.precompute_command(
        args, tmp_path / "data" / "train.jsonl", stores / spec.name("train"), spec
    )
    assert cmd[1:3] == ["-m", "precompute.cli"]
    cfg = load_config(
        PrecomputeConfig, None, [a for a in cmd[3:] if a.startswith("--") and "=" in a]
    )
    assert cfg.store.dtype == "q4_hadamard" and cfg.target.layer_ids == [0, 1, 2, 3]
    assert not cfg.store.final_state  # only stores/train keeps final states (soft-target variants)


def test_the_q4_variant_has_a_store_of_its_own_in_both_regimes(tmp_path):
    """dpace+q4 trains from a q4_hadamard store of the same answers, made in the data stage beside
    stores/train (bf16 in the small regime, fp8 in the rich one), and is evaluated on the held-out
    store every variant shares; a variant whose dtype is the regime's reads stores/train itself."""
    run = _runner()
    stores = tmp_path / "stores"
    for regime, base in (("small", "bf16"), ("rich", "fp8_e4m3")):
        args = run.parse(
            ["--work", str(tmp_path), "--regime", regime, "--variants", "dpace,dpace+q4,fp8"]
        )
        q4 = run.STORES["dpace+q4"]
        assert run.training_stores(args) == [
            ("train", run.DEFAULT_STORE),
            ("train-q4_hadamard", q4),
        ] + ([("train-fp8_e4m3", run.STORES["fp8"])] if regime == "small" else [])
        for spec, dtype in ((run.DEFAULT_STORE, base), (q4, "q4_hadamard")):
            cmd = run.precompute_command(
                args, tmp_path / "train.jsonl", stores / spec.name("train"), spec
            )
            cfg = load_config(
                PrecomputeConfig, None, [a for a in cmd[3:] if a.startswith("--") and "=" in a]
            )
            assert cfg.store.dtype == dtype
        dpace = load_config(TrainConfig, None, run.train_command(args, "dpace", 0)[3:])
        cfg = load_config(TrainConfig, None, run.train_command(args, "dpace+q4", 0)[3:])
        assert cfg.data.stores == [str(stores / "train-q4_hadamard")]
        assert dataclasses.replace(cfg.data, stores=dpace.data.stores) == dpace.data
        assert (cfg.objective, cfg.optim, cfg.drafter) == (
            dpace.objective,
            dpace.optim,
            dpace.drafter,
        )
        heldout = run.eval_commands(args, tmp_path / "runs" / "dpace+q4" / "seed-0")[
            "offline_heldout"
        ]
        assert heldout[heldout.index("--store") + 1] == str(stores / "heldout")
        fp8 = load_config(TrainConfig, None, run.train_command(args, "fp8", 0)[3:])
        assert fp8.data.stores == [
            str(stores / ("train" if regime == "rich" else "train-fp8_e4m3"))
        ]


def test_eval_commands_parse_and_ask_for_float32_and_lossless(tmp_path):
    run = _runner()
    args = run.parse(["--work", str(tmp_path)])
    cmds = run.eval_commands(args, tmp_path / "runs" / "baseline" / "seed-0")
    shortcuts = {
        "--drafter": "--drafter.path",
        "--report": "--report.path",
        "--store": "--offline.store",
    }
    for name, cmd in cmds.items():
        argv = [a for a in cmd[3:] if a != "--offline"]
        argv = [f"{shortcuts[a]}={b}" for a, b in zip(argv[::1], argv[1:]) if a in shortcuts] + [
            a for i, a in enumerate(argv) if a.startswith("--") and a not in shortcuts and "=" in a
        ]
        cfg = load_config(EvalConfig, None, argv)
        assert cfg.generation.max_new_tokens == args.max_new_tokens
    real = load_config(EvalConfig, None, [a for a in cmds["eval"][3:] if "=" in a])
    assert real.target.dtype == "float32" and real.check.lossless == "error"
    hot = load_config(EvalConfig, None, [a for a in cmds["eval_t1"][3:] if "=" in a])
    assert hot.generation.temperature == 1.0 and hot.generation.draft_sampling == "probabilistic"
    dflash2 = tmp_path / "runs" / "dflash2" / "seed-0"  # its walk is no draw: greedy drafts
    (dflash2 / "drafter").mkdir(parents=True)
    (dflash2 / "drafter" / "config.json").write_text('{"architectures": ["DFlash2DraftModel"]}')
    walk = run.eval_commands(args, dflash2)["eval_t1"]
    assert "--generation.draft_sampling=greedy" in walk


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        _runner().parse(["--work", str(tmp_path), "--variants", "nope"])


def test_the_rich_regime_trains_about_one_pass_at_the_small_regimes_steps(tmp_path):
    """rich: the same 450 steps of 16K tokens (max_steps), at most 2 epochs over ~5x the prompts."""
    run = _runner()
    args = run.parse(
        ["--work", str(tmp_path), "--regime", "rich", "--variants", "dpace", "--seeds", "0"]
    )
    assert args.train_prompts == 24000 and run.settings(args)["regime"] == "rich"
    cfg = load_config(TrainConfig, None, run.train_command(args, "dpace", 0)[3:])
    assert (cfg.optim.max_steps, cfg.optim.epochs, cfg.data.batch_tokens) == (450, 2, 16384)
    small = run.parse(["--work", str(tmp_path), "--variants", "dpace", "--seeds", "0"])
    assert (
        load_config(TrainConfig, None, run.train_command(small, "dpace", 0)[3:]).optim.max_steps
        is None
    )


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


def test_the_table_says_whether_the_drafter_generalises(tmp_path):
    """one_run reads the last training record and the last validation of metrics.jsonl: held-out CE
    over training CE, and the accuracy gap; runs from before `ce` have the gap alone."""
    run = _runner()
    out = tmp_path / "run"
    out.mkdir()
    rows = [
        {"kind": "train", "step": 10, "tok_s": 1.0, "loss": 0.5, "ce": 3.0, "acc": 0.30},
        {"kind": "val", "step": 10, "loss": 3.5, "ce": 3.2, "acc": 0.31, "tau": 2.0},
        {"kind": "train", "step": 20, "tok_s": 1.0, "loss": 0.4, "ce": 2.0, "acc": 0.40},
        {"kind": "val", "step": 20, "loss": 3.4, "ce": 2.5, "acc": 0.32, "tau": 2.1},
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = run.one_run(out)
    assert got["ce_ratio"] == pytest.approx(1.25) and got["acc_gap"] == pytest.approx(0.08)
    old = run.generalisation({"acc": 0.3, "loss": 0.5}, {"acc": 0.29, "loss": 3.4})
    assert old["ce_ratio"] is None and old["acc_gap"] == pytest.approx(0.01)
