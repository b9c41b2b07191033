"""dflash-precompute into a store it must not write: one made from another target or with other
settings, one of an unknown format version, one whose root metadata is cut. Each is one sentence
(exit 2) before any work, and the store is left exactly as it was; the fix a sentence gives
works."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from dflash_common.dirlock import LOCK_FILE
from dflash_common.store import Store
from dflash_common.tiny import TinySpec, build_tiny_target
from precompute import job
from precompute.cli import main
from precompute.tokenizing import TOKENIZE_VERSION

from precompute_helpers import cli_args, demo_inputs, job_overrides, make_config, store_files


@pytest.fixture(scope="module")
def made(tiny_target, tmp_path_factory):
    """(inputs, a finished store of 3 shards) from the tiny target."""
    d = tmp_path_factory.mktemp("made")
    inputs = demo_inputs(d)[1:]  # b.jsonl: 18 records
    store = d / "store"
    job.run(make_config(tiny_target, inputs, store, *job_overrides("bf16", samples_per_unit=6)))
    return inputs, store


def _tree(path) -> dict[str, str]:
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != LOCK_FILE
    }  # the holder's pid


def _refused(capsys, args, store) -> str:
    """Run dflash-precompute: exit 2, one line, no
    traceback, nothing of the store changed; -> the line."""
    before = _tree(store)
    with pytest.raises(SystemExit) as caught:
        main(args)
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "Traceback" not in err and err.count("error: ") == 1, err
    assert _tree(store) == before
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("change", ["target_weights", "target_weights_and_name", "store_dtype"])
def test_a_store_of_another_target_is_refused_and_left_alone(
    made, tiny_target, tmp_path, capsys, change
):
    inputs, made_store = made
    store = shutil.copytree(made_store, tmp_path / "store")
    target, dtype = tiny_target, "bf16"
    if change == "target_weights":  # the same architecture and tokenizer, other weights
        target = build_tiny_target(
            tmp_path / "other" / tiny_target.name, TinySpec(seed=5)
        )  # even its name
    elif change == "target_weights_and_name":  # refused by what differs (weights), not by the name
        target = build_tiny_target(tmp_path / "other" / "a-finetune", TinySpec(seed=5))
    else:
        dtype = "fp8_e4m3"
    line = _refused(capsys, cli_args(target, inputs, store, dtype, samples_per_unit=6), store)
    key = "target.weights_sha256" if change.startswith("target_weights") else "dtype"
    assert line.startswith(f"error: Store {store} was made with {key} = "), line
    assert line.endswith("; use a new store path, or the settings the store was made with."), line


def test_a_store_of_an_older_tokenization_is_refused_naming_the_version(
    made, tiny_target, tmp_path, capsys
):
    # e.g. a store of TOKENIZE_VERSION 2, whose sample ids carried paths: resuming it would write
    # every unit a second time under its new name
    inputs, made_store = made
    store = shutil.copytree(made_store, tmp_path / "store")
    root = store / "zarr.json"
    meta = json.loads(root.read_text())
    meta["attributes"]["precompute"]["tokenize_version"] = 2
    root.write_text(json.dumps(meta))
    line = _refused(capsys, cli_args(tiny_target, inputs, store, "bf16", samples_per_unit=6), store)
    assert line == (
        f"error: Store {store} was made with precompute.tokenize_version = 2, but this run has "
        f"precompute.tokenize_version = {TOKENIZE_VERSION}; use a new store path, or the dflash "
        "version that made it."
    ), line


@pytest.mark.parametrize("damage", ["format_version", "cut_root_metadata"])
def test_a_store_this_dflash_cannot_read_is_refused_and_left_alone(
    made, tiny_target, tmp_path, capsys, damage
):
    inputs, made_store = made
    store = shutil.copytree(made_store, tmp_path / "store")
    root = store / "zarr.json"
    if damage == "format_version":
        meta = json.loads(root.read_text())
        meta["attributes"]["format_version"] = 3
        root.write_text(json.dumps(meta))
        want = f"store {store} has store format version 3, but this dflash reads versions 1, 2"
    else:
        root.write_text(root.read_text()[:200])
        want = f"store {store} has an unreadable zarr.json"
    args = cli_args(tiny_target, inputs, store, "bf16", samples_per_unit=6)
    line = _refused(capsys, args, store)
    assert want in line, line
    if (
        damage == "cut_root_metadata"
    ):  # the fix the sentence gives: delete it and rerun, the shards are kept
        assert "delete that file and rerun dflash-precompute" in line
        root.unlink()
        main(args)
        assert store_files(store) == store_files(made_store)
        assert Store.open(store).summary["runs"][-1]["units_written"] == 0


def test_precompute_resumes_with_the_same_target_copied_under_another_name(
    tiny_target, tmp_path, capsys
):
    inputs = demo_inputs(tmp_path)[1:]
    store = tmp_path / "store"
    main(cli_args(tiny_target, inputs, store, "bf16", samples_per_unit=6))
    before = store_files(store)
    assert "target_head" in json.loads((store / "zarr.json").read_text())["attributes"]
    renamed = shutil.copytree(tiny_target, tmp_path / "copies" / "my-target-copy")
    capsys.readouterr()
    main(
        cli_args(renamed, inputs, store, "bf16", samples_per_unit=6)
    )  # refused before: target.name differed
    assert "0 shards written" in capsys.readouterr().out
    assert store_files(store) == before
