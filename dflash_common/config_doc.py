"""Render docs/config.md, the configuration reference, from the config dataclasses themselves.

The stages are passed in (tools/config_doc.py lists them), so this module imports no stage:

    python tools/config_doc.py            # rewrite docs/config.md
    python tools/config_doc.py --check    # exit 1 if docs/config.md is out of date

A test runs the check, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash_common.config import iter_fields

Stage = tuple[str, str, type]  # (stage, CLI, its config class), in the order of the data path
DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"
COMMAND = "python tools/config_doc.py"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(stages: Sequence[Stage]) -> str:
    lines = [
        "# Configuration reference",
        "",
        f"Generated from the config dataclasses by `{COMMAND}`; do not edit by hand.",
        "Every field can be set in a TOML file (`--config FILE`, sections as tables) and "
        "overridden on the",
        "command line as `--section.field=value` (lists as `1,9,17` or `[1, 9, 17]`).",
        "Shipped examples are in `configs/`: `<stage>-<name>.toml`.",
    ]
    for stage, cli, cls in stages:
        lines += [
            "",
            f"## {stage} (`{cli}`)",
            "",
            "| field | type | default | meaning |",
            "| --- | --- | --- | --- |",
        ]
        for key, tp, default, help in iter_fields(cls):
            lines.append(f"| `{key}` | {_cell(tp)} | `{_cell(repr(default))}` | {_cell(help)} |")
    return "\n".join(lines) + "\n"


def main(stages: Sequence[Stage], argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if docs/config.md is out of date"
    )
    args = parser.parse_args(argv)
    text = render(stages)
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is out of date; run: {COMMAND}", file=sys.stderr)
            sys.exit(1)
        return
    DOC.write_text(text)
    print(f"wrote {DOC}")
