"""dflash-train from the tiny target's real store (dflash-precompute of 48 demo records) when the
store no longer holds what it says: a deleted shard stops training in one sentence naming it and the
fix, or, with data.on_bad_shard = "skip", is left out with a warning; a root zarr.json edited by
hand is blamed as such, never a shard; a store without a summary (still being written) trains with
a warning."""

from __future__ import annotations

import json
import shutil

import pytest

from precompute.cli import main as precompute_main
from train import loop
from train.cli import main as train_main
from train.cli import parse

from fault_helpers import ROOT, copy_store, shard_names
from train_helpers import train_args


@pytest.fixture(scope="module")
def made(tiny_target, tmp_path_factory):
    """The store `dflash-precompute --config configs/tiny.toml` writes from 48 demo records (6
    units)."""
    d = tmp_path_factory.mktemp("made")
    data = d / "train.jsonl"
    data.write_text(
        "".join((ROOT / "data" / "tiny-train.jsonl").read_text().splitlines(keepends=True)[:48])
    )
    store = d / "store"
    precompute_main(
        [
            "--config",
            str(ROOT / "configs" / "tiny.toml"),
            "--out",
            str(store),
            f"--target.path={tiny_target}",
            f"--data.inputs={json.dumps([str(data)])}",
            "--data.block_size=4",
            "--run.samples_per_unit=8",
            "--run.device=cpu",
            "--target.dtype=fp32",
            "--run.progress=false",
        ]
    )
    assert len(shard_names(store)) == 6
    return store


def _edit_root(store, key, value) -> None:
    meta = json.loads((store / "zarr.json").read_text())
    if value is None:
        del meta["attributes"][key]
    else:
        meta["attributes"][key] = value
    (store / "zarr.json").write_text(json.dumps(meta, indent=2))


def _refused(capsys, args) -> str:
    with pytest.raises(SystemExit) as e:
        train_main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_training_stops_at_a_missing_shard_naming_it_and_the_fix(
    made, tiny_target, tmp_path, capsys
):
    store = copy_store(made, tmp_path / "store")
    lost = shard_names(store)[2]
    shutil.rmtree(store / "shards" / lost)
    line = _refused(capsys, train_args(store, tiny_target, tmp_path / "run", "--optim.max_steps=2"))
    assert line == (
        f"error: store {store} lacks 1 of the 6 shards its summary lists ({lost}); rerun "
        f"dflash-precompute with the command that wrote the store: it resumes and writes only the "
        f'missing shards, or set data.on_bad_shard = "skip" to train on the 5 shards there.'
    ), line
    assert not list((tmp_path / "run").glob("step-*"))  # refused before the first step


def test_skip_trains_on_the_shards_there_and_names_the_missing_one(
    made, tiny_target, tmp_path, caplog
):
    store = copy_store(made, tmp_path / "store")
    lost = shard_names(store)[2]
    shutil.rmtree(store / "shards" / lost)
    run = tmp_path / "run"
    loop.run(
        parse(
            train_args(
                store,
                tiny_target,
                run,
                "--optim.max_steps=2",
                "--data.on_bad_shard=skip",
            )
        )
    )
    warned = [m for m in caplog.messages if m.startswith(f"store {store} lacks 1 of the 6 shards")]
    assert len(warned) == 1 and lost in warned[0], caplog.messages
    assert warned[0].endswith("; training on the 5 shard(s) there (data.on_bad_shard = skip)")
    assert (run / "drafter" / "model.safetensors").is_file()


def test_a_changed_root_dtype_is_blamed_not_the_shards(made, tiny_target, tmp_path, capsys):
    store = copy_store(made, tmp_path / "store")
    _edit_root(store, "dtype", "fp8_e4m3")
    line = _refused(capsys, train_args(store, tiny_target, tmp_path / "run", "--optim.max_steps=2"))
    assert line == (
        f"error: the root zarr.json of store {store} was changed: it says dtype = "
        '"fp8_e4m3", but all 6 readable shards were written with dtype = "bf16"; set "dtype" back '
        f'to "bf16" in {store / "zarr.json"} (the shards are intact: do not delete them).'
    ), line


def test_a_store_without_a_summary_trains_with_a_warning(made, tiny_target, tmp_path, caplog):
    store = copy_store(made, tmp_path / "store")
    _edit_root(store, "summary", None)  # dflash-precompute writes it last
    loop.run(parse(train_args(store, tiny_target, tmp_path / "run", "--optim.max_steps=1")))
    assert any(
        m.startswith(f"store {store} is incomplete: it has no summary yet") for m in caplog.messages
    )
