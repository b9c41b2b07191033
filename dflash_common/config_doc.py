"""Generate docs/config.md, the configuration reference, from the config dataclasses themselves.

    python -m dflash_common.config_doc            # rewrite docs/config.md
    python -m dflash_common.config_doc --check    # exit 1 if docs/config.md is out of date

A test runs the check, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from dflash_common.config import iter_fields

# (stage, CLI, "module:Class") in the order of the data path
STAGES = [
    ("precompute", "dflash-precompute", "dflash_common.precompute_config:PrecomputeConfig"),
    ("train", "dflash-train", "dflash_common.train_config:TrainConfig"),
    ("eval", "dflash-eval", "dflash_common.eval_config:EvalConfig"),
]
DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def stage_class(spec: str) -> type:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses by `python -m dflash_common.config_doc`; do not edit by hand.",
        "Every field can be set in a TOML file (`--config FILE`, sections as tables) and overridden on the",
        "command line as `--section.field=value` (lists as `1,9,17` or `[1, 9, 17]`).",
        "Shipped examples are in `configs/`: `<stage>-<name>.toml`.",
    ]
    for stage, cli, spec in STAGES:
        lines += ["", f"## {stage} (`{cli}`)", "", "| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for key, tp, default, help in iter_fields(stage_class(spec)):
            lines.append(f"| `{key}` | {_cell(tp)} | `{_cell(repr(default))}` | {_cell(help)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is out of date; run: python -m dflash_common.config_doc", file=sys.stderr)
            sys.exit(1)
        return
    DOC.write_text(text)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
