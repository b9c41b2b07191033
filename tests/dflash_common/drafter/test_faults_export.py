"""`dflash-export --overwrite` replaces only an exported drafter, never the source or anything else;
a missing or cut model.safetensors is one sentence with the fix (export and eval load alike)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dflash_common.drafter.export import load_drafter, main, save_drafter

from drafter_testlib import tiny_config, tiny_drafter


def _run_dir(root: Path, drafter) -> Path:
    """A run directory as the trainer leaves it: step-1/ (drafter + COMPLETE), metrics, drafter/."""
    run = root / "run"
    save_drafter(drafter, run / "step-1" / "drafter")
    (run / "step-1" / "COMPLETE").write_text("")
    save_drafter(drafter, run / "drafter")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def drafter(tiny_target):
    return tiny_drafter(tiny_config(tiny_target))


def test_overwrite_never_deletes_the_source_a_parent_a_step_or_foreign_files(drafter, tmp_path, capsys):
    run = _run_dir(tmp_path, drafter)
    sibling = save_drafter(drafter, tmp_path / "other-drafter")
    (tmp_path / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    for out, says in [(run, "is the source"), (tmp_path, "a parent of the source"),
                      (run / "step-1", "inside the source"), (run / "drafter", "inside the source")]:
        err = _refused([str(run), str(out), "--overwrite"], capsys)
        assert says in err and len(err.strip().splitlines()) == 1
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    (foreign / "data.bin").write_text("keep")
    err = _refused([str(run), str(foreign), "--overwrite"], capsys)
    assert "is not an exported drafter (it holds data.bin)" in err
    assert _tree(tmp_path) == {**before, "foreign/config.json": b"{}", "foreign/data.bin": b"keep"}
    main([str(run), str(sibling), "--overwrite"])  # an exported drafter outside the run is replaced
    assert json.loads((sibling / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in sibling.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("damage", ["missing", "cut"])
def test_a_missing_or_cut_weights_file_is_one_sentence_with_the_fix(drafter, tmp_path, capsys, damage):
    out = save_drafter(drafter, tmp_path / "d")
    weights = out / "model.safetensors"
    if damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = _refused([str(out), str(tmp_path / "e")], capsys)
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1 and "dflash-export RUN_DIR" in err
    with pytest.raises(Exception, match="dflash-export RUN_DIR") as info:  # the loader dflash-eval uses
        load_drafter(out)
    assert type(info.value).__name__ == "UserError"


# Hand edits of an exported config.json (issue 40): each would load, evaluate and export as another
# drafter than was trained; the record saved inside model.safetensors names the key.
HAND_EDITS = {
    "layer ids shifted": (lambda c: c["dflash_config"].update(target_layer_ids=[2, 3, 4, 5, 6]),
                          "says `dflash_config.target_layer_ids` = [2, 3, 4, 5, 6] where its weights were "
                          "trained with [1, 2, 3, 4, 5]"),
    "block_size removed": (lambda c: c.pop("block_size"),
                           "lacks `block_size`, which reads as 16, where its weights were trained with 8"),
    "hidden_size removed": (lambda c: c.pop("hidden_size"), "lacks `hidden_size`; put back `hidden_size: 64`"),
}


@pytest.mark.parametrize("edit", list(HAND_EDITS))
def test_a_hand_edited_config_is_refused_naming_the_key(tiny_target, tmp_path, capsys, edit):
    from dflash_common.drafter import serving

    drafter = tiny_drafter(tiny_config(tiny_target, block_size=8, layer_types=None, sliding_window=None))
    run = _run_dir(tmp_path, drafter)
    change, says = HAND_EDITS[edit]
    for directory in (run / "step-1" / "drafter", run / "drafter"):
        config = json.loads((directory / "config.json").read_text())
        change(config)
        (directory / "config.json").write_text(json.dumps(config))
    for source in (run, run / "step-1", run / "drafter"):  # dflash-export of a run, a step, a drafter
        err = _refused([str(source), str(tmp_path / "out")], capsys)
        assert len(err.strip().splitlines()) == 1 and says in err, err
        assert "export the drafter again from its run" in err and "'hidden_size'" not in err
        assert not (tmp_path / "out").exists()
    with pytest.raises(Exception, match=re.escape(says)) as info:  # the loader dflash-eval and resume use
        load_drafter(run / "drafter")
    assert type(info.value).__name__ == "UserError"
    assert any(says in f.message for f in serving.errors(serving.lint_drafter_dir(run / "drafter")))


def test_a_config_without_a_record_names_a_missing_key_in_a_sentence(drafter, tmp_path):
    """A drafter whose weights were saved by another tool (no record): a missing key is still named."""
    from safetensors.torch import load_file, save_file

    out = save_drafter(drafter, tmp_path / "d")
    save_file(load_file(out / "model.safetensors"), str(out / "model.safetensors"), metadata={"format": "pt"})
    load_drafter(out)  # unedited: loads
    config = json.loads((out / "config.json").read_text())
    del config["hidden_size"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=re.escape(f"{out / 'config.json'} lacks `hidden_size`; add it")):
        load_drafter(out)
