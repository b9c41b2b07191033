"""docs/config.md is generated from the dataclasses and must match them."""

import importlib.util
from pathlib import Path

from dflash_common.config import iter_fields
from dflash_common.config_doc import COMMAND, DOC, render

_spec = importlib.util.spec_from_file_location(
    "config_doc_tool", Path(__file__).parents[1] / "tools" / "config_doc.py"
)
_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tool)
STAGES = _tool.STAGES


def test_reference_is_current():
    assert DOC.read_text() == render(STAGES), f"docs/config.md is out of date: {COMMAND}"


def test_every_field_is_documented_with_help():
    text = render(STAGES)
    for _, _, cls in STAGES:
        for key, _, _, help in iter_fields(cls):
            assert help.strip(), f"{cls.__name__} field {key} has no help text"
            assert f"`{key}`" in text
