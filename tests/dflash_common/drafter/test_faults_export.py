"""`dflash-export --overwrite` replaces only an exported drafter, never the source or anything else;
a missing or cut model.safetensors is one sentence with the fix (export and eval load alike)."""

from __future__ import annotations

import json
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
