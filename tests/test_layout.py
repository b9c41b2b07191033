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


PACKAGES = ("dflash_common", "precompute", "train")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (at the top or inside a function: a lazy import that
    closes a cycle is still a cycle). `from a.b import c` names module a.b.c when it exists, else a.b;
    importing a submodule does not count as importing its package's __init__."""
    files = {_module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in files:
                subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                edges.update(subs or {node.module})
                if len(subs) < len(node.names):
                    edges.add(node.module)
        graph[name] = edges - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_cycles():
    cycle = _cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_checker_finds_a_lazy_cycle(tmp_path):
    pkg = tmp_path / "train"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from train.b import thing\n")
    (pkg / "b.py").write_text("def f():\n    from train import a\n")
    assert _cycle(_import_graph(tmp_path)) == ["train.a", "train.b", "train.a"]


def test_the_store_and_the_drafter_have_their_rooms():
    for room in ("format", "chunks", "quant", "writer", "reader", "verify", "cli"):
        assert (ROOT / "dflash_common" / "store" / f"{room}.py").is_file(), room
    drafter = ROOT / "dflash_common" / "drafter"
    for room in ("config", "model", "attention", "layer_ids", "objective", "target_head", "export"):
        assert (drafter / f"{room}.py").is_file(), room
    for room in ("__init__", "hard", "hard_triton", "epilogue_triton", "soft", "soft_triton"):
        assert (drafter / "loss" / f"{room}.py").is_file(), f"loss/{room}"
    for old in ("loss", "loss_triton", "loss_epilogue_triton", "soft_loss", "soft_loss_triton"):
        assert not (drafter / f"{old}.py").exists(), f"{old}.py has its room in loss/ now"
    for stage in ("precompute", "train"):
        assert (ROOT / stage / "config.py").is_file(), f"{stage}'s config lives beside its stage"


def test_evaluation_is_one_package_and_the_objective_a_training_module():
    for room in ("cli", "config", "run", "prompts", "load", "spec_decode", "report", "offline", "baseline_cache",
                 "vllm_engine"):
        assert (ROOT / "train" / "eval" / f"{room}.py").is_file(), room
    for moved in ("evaluate", "eval_config", "spec_decode", "vllm_engine", "baseline_cache"):
        assert not (ROOT / "train" / f"{moved}.py").exists(), f"train/{moved}.py belongs in train/eval/"
    assert (ROOT / "train" / "objective.py").is_file(), "the step's objective lives in train/objective.py"


def test_generate_and_the_precompute_plan_have_their_rooms():
    for room in ("cli", "config", "job", "chats", "decode", "attention", "cuda_graph"):
        assert (ROOT / "precompute" / "generate" / f"{room}.py").is_file(), room
    assert not sorted((ROOT / "precompute").glob("generate_*.py")), "dflash-generate lives in precompute/generate/"
    for room in ("units", "tokenizing", "plan"):
        assert (ROOT / "precompute" / f"{room}.py").is_file(), room


def test_test_files_have_unique_names():
    """tests/ has no __init__.py files: pytest imports each test module by its file name, so two of
    one name in different folders break the collection of both."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert not {n for n in names if names.count(n) > 1}


# What two modules may both define: conventional entry points (a CLI's `main` and `parse`, a job's
# `run` and the `_run` inside it). Everything else is written once and imported.
ENTRY_NAMES = frozenset({"main", "parse", "run", "_run"})
# Bodies that are no helper to share: an empty one, and what context managers and iterators write.
_BOILERPLATE = ("pass", "...", "return self", "self.close()")
_PROTOCOL_BODIES = frozenset(ast.dump(ast.parse(code)) for code in _BOILERPLATE)


def _modules(root: Path) -> dict[Path, ast.Module]:
    paths = [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))]
    return {p: ast.parse(p.read_text(), filename=str(p)) for p in paths}


def _is_stage_config(path: Path, root: Path) -> bool:
    """A stage's config.py: its section classes are named after its TOML tables ([run], [data]),
    which two stages may share."""
    return path.name == "config.py" and path.relative_to(root).parts[0] != "dflash_common"


def _duplicate_names(root: Path = ROOT) -> dict[str, list[str]]:
    """Top-level function and class names defined in more than one module (entry names aside)."""
    where: dict[str, list[str]] = {}
    for path, tree in _modules(root).items():
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            section = isinstance(node, ast.ClassDef) and _is_stage_config(path, root)
            if node.name in ENTRY_NAMES or section:
                continue
            where.setdefault(node.name, []).append(str(path.relative_to(root)))
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def _duplicate_bodies(root: Path = ROOT) -> list[list[str]]:
    """Groups of functions (methods and nested ones too), under any names, whose bodies are the
    same code (`ast.dump` equal, the docstring left out)."""
    bodies: dict[str, list[str]] = {}
    for path, tree in _modules(root).items():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            dumped = ast.dump(ast.Module(body=body, type_ignores=[]))
            if body and dumped not in _PROTOCOL_BODIES:
                place = f"{path.relative_to(root)}:{node.lineno} {node.name}"
                bodies.setdefault(dumped, []).append(place)
    return [places for places in bodies.values() if len(places) > 1]


def test_no_helper_is_defined_twice():
    assert _duplicate_names() == {}, "defined in several modules: write it once (in dflash_common?)"
    assert _duplicate_bodies() == [], "the same function body twice: keep one and call it"


_A = '''
def run():
    pass

class Bar:
    def __enter__(self):
        return self

def load(p):
    return p.read()

def human_bytes(n):
    return f"{n} B"
'''
_B = '''
def run():
    pass

class Other:
    def __enter__(self):
        return self

def load(p):
    return None

def size(n):
    """Sizes."""
    return f"{n} B"
'''


def test_the_duplicate_checkers_find_copies(tmp_path):
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    for stage in ("precompute", "train"):  # two stages' [run] tables: allowed
        (tmp_path / stage / "config.py").write_text("class RunConfig:\n    pass\n")
    (tmp_path / "precompute" / "a.py").write_text(_A)
    (tmp_path / "train" / "b.py").write_text(_B)
    assert _duplicate_names(tmp_path) == {"load": ["precompute/a.py", "train/b.py"]}
    assert _duplicate_bodies(tmp_path) == [["precompute/a.py:12 human_bytes", "train/b.py:12 size"]]
