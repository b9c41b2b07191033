"""The package layout rules of STYLE.md, checked by parsing imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_precompute_and_train_never_import_each_other():
    for package, forbidden in (("precompute", "train"), ("train", "precompute")):
        files = _sources(package)
        assert files, f"{package}/ has no sources"
        for path in files:
            assert forbidden not in _imported_top_levels(path), f"{path.relative_to(ROOT)} imports {forbidden}"


def test_common_imports_neither_stage():
    for path in _sources("dflash_common"):
        bad = _imported_top_levels(path) & {"precompute", "train"}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}; shared code must not depend on a stage"


def test_the_checker_sees_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import train.loop\nfrom precompute.cli import main\n")
    assert _imported_top_levels(probe) == {"train", "precompute"}
