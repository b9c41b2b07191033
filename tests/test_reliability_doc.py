"""docs/reliability.md names the test that proves each guarantee: every name must exist, and every
fault test must be named there (a promise without its test, or a test without its promise, is a
gap)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"
# `dir/test_x.py::test_name`, or `...::test_name` for another test of the file named just before
_REFERENCE = re.compile(r"`((?:[\w/]+\.py)|\.\.\.)::(\w+)`")


def _referenced() -> list[tuple[str, str]]:
    refs, last = [], None
    for path, name in _REFERENCE.findall(DOC.read_text()):
        last = last if path == "..." else path
        assert last is not None, f"`...::{name}` in {DOC} follows no file"
        refs.append((last, name))
    return refs


def _tests_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def test_every_test_the_reliability_doc_names_exists():
    refs = _referenced()
    assert len(refs) > 40
    missing = [
        f"{path}::{name}"
        for path, name in refs
        if not (ROOT / "tests" / path).is_file() or name not in _tests_of(ROOT / "tests" / path)
    ]
    assert not missing, f"{DOC} names tests that do not exist: {missing}"


def test_every_fault_test_is_named_in_the_reliability_doc():
    named = set(_referenced())
    fault_files = sorted((ROOT / "tests").rglob("test_faults_*.py"))
    assert len(fault_files) >= 8
    unnamed = [
        f"{f.relative_to(ROOT / 'tests')}::{t}"
        for f in fault_files
        for t in sorted(_tests_of(f))
        if (str(f.relative_to(ROOT / "tests")), t) not in named
    ]
    assert not unnamed, f"fault tests that {DOC} does not name: {unnamed}"
