"""Mismatches through the command lines: a store of other layers, hidden size or tokenizer than the
drafter; a store of an unknown format version; stores of different targets mixed; an empty store; a
checkpoint of another drafter given to resume or as init. Each is one sentence on stderr and exit 2,
and nothing already written is lost."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from dflash_common.dirlock import LOCK_FILE  # the holder's pid: rewritten by each run
from dflash_common.drafter.config import DrafterConfig
from dflash_common.drafter.export import save_drafter
from dflash_common.drafter.model import DFlashDrafter
from dflash_common.store import StoreWriter
from dflash_common.store.cli import main as store_main
from dflash_common.tiny import MASK_TOKEN, TinySpec, build_tiny_target
from train.checkpoint import complete_checkpoints
from train.cli import main as train_main

from fault_helpers import copy_store
from train_helpers import train_args
from train_helpers import write_tiny_store


@pytest.fixture(scope="module")
def narrow_target(tmp_path_factory):
    """A tiny target of hidden size 32 (same tokenizer and template)."""
    return build_tiny_target(
        tmp_path_factory.mktemp("narrow"), TinySpec(hidden_size=32, head_dim=8)
    )


@pytest.fixture(scope="module")
def reseeded_target(tmp_path_factory):
    """The tiny target's architecture, tokenizer and template with other weights."""
    return build_tiny_target(tmp_path_factory.mktemp("reseeded"), TinySpec(seed=5))


def _fails(capsys, argv, main=train_main) -> str:
    """Run a CLI; it must exit 2 with one line on stderr, which is returned."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err and err[-1].startswith("error: "), err
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_a_store_of_other_layers_than_the_drafter_reads(tiny_store, tiny_target, tmp_path, capsys):
    line = _fails(
        capsys, train_args(tiny_store, tiny_target, tmp_path / "run", "--drafter.layer_ids=[1,6]")
    )
    assert "holds target layers [1, 2, 3, 4, 5], but the drafter also reads [6]" in line
    assert "precompute a store that captures [1, 6]" in line


def test_a_store_of_another_hidden_size(narrow_target, tiny_target, tmp_path, capsys):
    store = write_tiny_store(tmp_path / "narrow-store", narrow_target, n_shards=2, per_shard=4)
    line = _fails(capsys, train_args(store, tiny_target, tmp_path / "run"))
    assert f"store {store} holds states of hidden size 32, but the drafter needs 64" in line
    assert "use a store precomputed from the drafter's target" in line


def test_a_store_of_another_tokenizer(tiny_store, tiny_target, tmp_path, capsys):
    other = tmp_path / "target-with-more-tokens"
    shutil.copytree(tiny_target, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<|extra|>"], special_tokens=True)
    tok.save_pretrained(other)
    line = _fails(capsys, train_args(tiny_store, other, tmp_path / "run"))
    assert (
        f"store {tiny_store} was precomputed with tokenizer" in line
        and "but the drafter's tokenizer is" in line
    )
    assert "train with the tokenizer of the store's target" in line


def test_a_store_of_an_unknown_format_version(tiny_store, tiny_target, tmp_path, capsys):
    store = copy_store(tiny_store, tmp_path / "v3")
    meta = json.loads((store / "zarr.json").read_text())
    meta["attributes"]["format_version"] = 3
    (store / "zarr.json").write_text(json.dumps(meta))
    want = f"store {store} has store format version 3, but this dflash reads versions 1, 2"
    assert want in _fails(capsys, train_args(store, tiny_target, tmp_path / "run"))
    for cmd in ("info", "verify"):
        assert want in _fails(capsys, [cmd, str(store)], main=store_main)
    manifest = json.loads((tiny_store / "zarr.json").read_text())["attributes"]
    from dflash_common.store import StoreError, StoreManifest

    with pytest.raises(
        StoreError, match="format version 3"
    ):  # a writer refuses to add shards to it
        StoreWriter.create_or_open(store, StoreManifest.from_json(manifest))


def test_a_cut_root_metadata_file_is_one_sentence_with_the_fix(
    tiny_store, tiny_target, tmp_path, capsys
):
    store = copy_store(tiny_store, tmp_path / "cut")
    text = (store / "zarr.json").read_text()
    (store / "zarr.json").write_text(text[: len(text) // 2])
    line = _fails(capsys, train_args(store, tiny_target, tmp_path / "run"))
    assert (
        f"store {store} has an unreadable zarr.json" in line
        and "delete that file and rerun" in line
    )


def test_stores_of_different_targets_are_not_mixed(
    tiny_store, tiny_target, reseeded_target, narrow_target, tmp_path, capsys
):
    other = write_tiny_store(tmp_path / "other", reseeded_target, n_shards=2, per_shard=4)
    line = _fails(
        capsys, train_args(tiny_store, tiny_target, tmp_path / "run", "--store", str(other))
    )
    assert f"stores {tiny_store} and {other} differ in target.weights_sha256" in line
    assert "train from stores of one target and tokenizer" in line
    narrow = write_tiny_store(tmp_path / "narrow", narrow_target, n_shards=2, per_shard=4)
    line = _fails(
        capsys, train_args(tiny_store, tiny_target, tmp_path / "run", "--store", str(narrow))
    )
    assert "differ in hidden_size (64 vs 32)" in line


def test_an_empty_store_is_one_sentence(tiny_store, tiny_target, tmp_path, capsys):
    from dflash_common.store import StoreManifest

    manifest = StoreManifest.from_json(
        json.loads((tiny_store / "zarr.json").read_text())["attributes"]
    )
    empty = tmp_path / "empty"
    StoreWriter.create_or_open(empty, manifest)  # as precompute leaves it before its first shard
    line = _fails(capsys, train_args(empty, tiny_target, tmp_path / "run"))
    assert f"{empty} holds no readable shard; run dflash-precompute" in line


def test_a_checkpoint_of_another_drafter_is_refused_on_resume_and_as_init(
    tiny_store, tiny_target, tmp_path, narrow_target, capsys, monkeypatch
):
    import train.loop as loop

    monkeypatch.setattr(loop, "save_report", lambda *a, **k: None)  # drawing: not under test, slow
    run = tmp_path / "run"
    train_main(train_args(tiny_store, tiny_target, run, "--optim.max_steps=2", "--drafter.depth=1"))
    capsys.readouterr()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_FILE}
    line = _fails(
        capsys, train_args(tiny_store, tiny_target, run, "--optim.max_steps=4", "--drafter.depth=2")
    )
    assert (
        f"cannot resume from {run / 'step-2'}: it holds another drafter (num_hidden_layers = 1 "
        "there vs 2 here" in line
    )
    assert (
        f"resume with the settings of {run / 'step-2' / 'run.toml'}, or start a new run directory "
        "(--out)" in line
    )
    assert {
        p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_FILE
    } == before  # nothing written, nothing lost
    assert [s for s, _ in complete_checkpoints(run)] == [2]

    line = _fails(
        capsys,
        train_args(
            tiny_store,
            tiny_target,
            tmp_path / "init",
            "--drafter.depth=2",
            f"--drafter.init_from={run / 'step-2'}",
        ),
    )
    assert (
        f"cannot initialise from {run / 'step-2'}: its config differs (num_hidden_layers = 1 there "
        "vs 2 here" in line
    )

    mask = AutoTokenizer.from_pretrained(tiny_target).convert_tokens_to_ids(MASK_TOKEN)
    narrow = DrafterConfig.from_target(
        AutoConfig.from_pretrained(narrow_target), mask_token_id=mask, depth=1, block_size=4
    )
    torch.manual_seed(0)
    path = save_drafter(DFlashDrafter(narrow), tmp_path / "narrow-drafter")
    line = _fails(
        capsys,
        train_args(
            tiny_store,
            tiny_target,
            tmp_path / "init2",
            "--drafter.depth=1",
            f"--drafter.init_from={path}",
        ),
    )
    assert (
        f"cannot initialise from {path}: its config differs (hidden_size = 32 there vs 64 here"
        in line
    )


def test_a_checkpoint_of_another_number_of_ranks_is_refused(
    tiny_store, tiny_target, tmp_path, monkeypatch
):
    import train.loop as loop
    from dflash_common.dist import Ranks
    from dflash_common.errors import UserError

    monkeypatch.setattr(loop, "save_report", lambda *a, **k: None)
    run = tmp_path / "run"
    train_main(train_args(tiny_store, tiny_target, run, "--optim.max_steps=1"))
    two = Ranks(rank=0, world=2, device=torch.device("cpu"))  # as under torchrun --nproc-per-node=2
    with pytest.raises(UserError) as e:
        loop.resume(run / "step-1", two, None, None, None)
    assert str(e.value) == (
        f"{run / 'step-1'} was written by 1 rank(s) but this run has 2; resume with 1, or start "
        f"a new run directory (--out)."
    )


def test_a_refused_training_leaves_nothing_it_created(
    tiny_store, tiny_target, tmp_path, capsys, monkeypatch
):
    """No run directory holding only .dflash.lock, no ./runs/dflash/ of a run without arguments."""
    nested = tmp_path / "new" / "deeper" / "run"
    line = _fails(capsys, train_args(tiny_store, tiny_target, nested, "--drafter.layer_ids=[1,6]"))
    assert "the drafter also reads [6]" in line
    assert not (tmp_path / "new").exists()  # nor the parents it made
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(capsys, train_args(tiny_store, tiny_target, empty, "--drafter.layer_ids=[1,6]"))
    assert list(empty.iterdir()) == []  # the directory was the user's: kept, without a lock file
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert "No store given" in _fails(capsys, [])
    assert list(cwd.iterdir()) == []  # no runs/dflash/
