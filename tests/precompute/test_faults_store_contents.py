"""What a store says it holds against what it holds, on the tiny target's real store
(dflash-precompute of 48 demo records: 12 shards). A deleted shard is named by `dflash-store verify`
and `info` with the command that refills it, and that command refills exactly it; a summary from
before the shard list names it by its unit; a store still being written is incomplete, not bad; a
root zarr.json edited by hand is blamed as such, by every command, and no shard is called bad; and
precompute prints the size on disk that info prints."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest

from dflash_common.fsutil import human_bytes
from dflash_common.store import Store
from dflash_common.store.cli import format_info
from dflash_common.store.cli import main as store_main
from dflash_common.store.contents import precompute_record
from dflash_common.store.verify import store_info
from precompute.cli import main as precompute_main

from precompute_helpers import cli_args, demo_inputs, published, store_files


@pytest.fixture(scope="module")
def made(tiny_target, tmp_path_factory):
    """(inputs, the finished store, what dflash-precompute printed on stdout)."""
    d = tmp_path_factory.mktemp("made")
    inputs = demo_inputs(d)
    store = d / "store"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        precompute_main(cli_args(tiny_target, inputs, store, "bf16"))
    return inputs, store, printed.getvalue()


def _copy(made, tmp_path):
    """A copy of the made store, with its run record beside it (pointing at the copy), as precompute
    leaves them."""
    store = shutil.copytree(made[1], tmp_path / "store")
    record = precompute_record(made[1]).read_text()
    precompute_record(store).write_text(record.replace(str(made[1]), str(store)))
    return store


def _edit_root(store, **changes) -> None:
    """Set (value) or remove (None) root attributes, as a user editing zarr.json does."""
    meta = json.loads((store / "zarr.json").read_text())
    for key, value in changes.items():
        if value is None:
            meta["attributes"].pop(key, None)
        else:
            meta["attributes"][key] = value
    (store / "zarr.json").write_text(json.dumps(meta, indent=2))


def _info(store, capsys) -> tuple[dict, dict[str, str]]:
    """`dflash-store info` as JSON and as text rows {label: value}."""
    assert store_main(["info", str(store), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert store_main(["info", str(store)]) == 0
    return data, _rows(capsys.readouterr().out)


def _rows(text: str) -> dict[str, str]:
    pairs = (line.split("  ", 1) for line in text.splitlines() if "  " in line)
    return {label.strip(): value.strip() for label, value in pairs}


def test_a_deleted_shard_is_named_by_verify_and_info_and_the_command_they_give_refills_it(
    made, tmp_path, capsys
):
    store = _copy(made, tmp_path)
    lost = published(store)[4]
    assert lost.startswith("u00000004-")
    shutil.rmtree(store / "shards" / lost)  # rm -rf STORE/shards/u00000004-*
    assert store_main(["verify", str(store)]) == 1
    out, err = capsys.readouterr()
    assert out.split() == [lost]  # stdout: the missing shard, as bad ones are listed
    record = precompute_record(store)
    assert (
        f"store {store} lacks 1 of the 12 shards its summary lists ({lost}); rerun "
        f"dflash-precompute with the command that wrote the store (`dflash-precompute --config "
        f"{record}`): it resumes and writes only the missing shards."
    ) in err, err
    assert f"verified 11 shard(s) of {store}: 1 missing shard(s)" in err

    summary = Store.open(store).summary
    data, text = _info(store, capsys)
    assert (data["status"], data["shards"], data["expected_shards"]) == (
        "missing shards",
        11,
        12,
    )
    assert (
        data["missing_shards"] == [lost]
        and data["expected_tokens"] == summary["tokens"] > data["tokens"]
    )
    assert text["shards"] == "11 of the 12 its summary lists"
    assert text["tokens"] == f"{data['tokens']:,} of the {summary['tokens']:,} its summary lists"
    assert text["status"].startswith(f"1 shard(s) missing ({lost}): rerun dflash-precompute")

    precompute_main(["--config", str(record)])  # the fix, as the sentence gives it
    capsys.readouterr()
    assert store_files(store) == store_files(made[1])  # the very bytes of the lost shard
    assert Store.open(store).summary["runs"][-1]["units_written"] == 1
    assert store_main(["verify", str(store)]) == 0
    assert _info(store, capsys)[1]["status"] == "complete: every shard its summary lists"


def test_a_summary_from_before_the_shard_list_names_the_missing_shard_by_its_unit(
    made, tmp_path, capsys
):
    store = _copy(made, tmp_path)
    summary = Store.open(store).summary
    del summary["shards"]  # as a store of an earlier dflash holds it
    _edit_root(store, summary=summary)
    shutil.rmtree(next((store / "shards").glob("u00000004-*")))
    assert store_main(["verify", str(store)]) == 1
    out, err = capsys.readouterr()
    assert out.split() == ["u00000004-*"]
    assert f"store {store} lacks 1 of the 12 shards its summary lists (u00000004-*); rerun" in err
    data, _ = _info(store, capsys)
    assert data["missing_shards"] == ["u00000004-*"] and data["shards"] == 11


def test_a_store_still_being_written_is_incomplete_not_bad(made, tmp_path, capsys):
    store = _copy(made, tmp_path)
    _edit_root(store, summary=None)  # the summary is written last: a running or killed job has none
    shutil.rmtree(next((store / "shards").glob("u00000004-*")))  # a unit not computed yet
    assert store_main(["verify", str(store)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and f"verified 11 shard(s) of {store}: OK, but incomplete" in err
    assert f"store {store} is incomplete: it has no summary yet" in err
    data, text = _info(store, capsys)
    assert (
        data["status"],
        data["shards"],
        data["expected_shards"],
        data["missing_shards"],
    ) == ("incomplete", 11, None, [])
    assert text["status"].startswith("incomplete: no summary yet")


# (key, the value a user types, the value to restore: None removes the key, as it was written)
ROOT_EDITS = [
    ("dtype", "fp8_e4m3", "bf16"),
    ("layer_ids", [1, 2, 3], [1, 2, 3, 4, 5]),
    ("final_state", True, None),
    ("hidden_size", 128, 64),
]


@pytest.mark.parametrize("key, value, restore", ROOT_EDITS, ids=[e[0] for e in ROOT_EDITS])
def test_a_changed_root_metadata_is_blamed_by_every_command_and_no_shard(
    made, tiny_target, tmp_path, capsys, key, value, restore
):
    store = _copy(made, tmp_path)
    _edit_root(store, **{key: value})
    shards = store_files(store)
    fix = (
        f'remove "{key}" from'
        if restore is None
        else f'set "{key}" back to {json.dumps(restore)} in'
    )
    commands = [
        (store_main, ["verify", str(store)]),
        (store_main, ["info", str(store)]),
        (precompute_main, cli_args(tiny_target, made[0], store, "bf16")),
    ]
    for main, args in commands:
        with pytest.raises(SystemExit) as e:
            main(args)
        out, err = capsys.readouterr()
        line = err.strip().splitlines()[-1]
        assert e.value.code == 2 and "Traceback" not in err and out.count("u000") == 0, (
            args[0],
            err,
        )
        assert line.startswith(f"error: the root zarr.json of store {store} was changed: "), line
        assert line.endswith(
            f"; {fix} {store / 'zarr.json'} (the shards are intact: do not delete them)."
        ), line
        assert "all 12 readable shards" in line or "any of its 12 readable shards" in line
    assert store_files(store) == shards  # nothing deleted, nothing written
    _edit_root(store, **{key: restore})  # the fix the sentence gives
    assert store_main(["verify", str(store)]) == 0
    precompute_main(
        cli_args(tiny_target, made[0], store, "bf16")
    )  # and precompute takes the store again
    assert "0 shards written" in capsys.readouterr().out


def test_precompute_prints_the_size_on_disk_that_info_prints(made):
    _, store, printed = made
    with Store.open(store) as s:
        info = store_info(s)
    n = info["bytes_on_disk"]
    size = f"{human_bytes(n)} on disk ({n:,} B"
    assert size in printed, printed
    assert _rows(format_info(info))["on disk"].startswith(f"{human_bytes(n)} ({n:,} B")
    assert printed.count(" on disk") == 1  # no second size beside it that could disagree
