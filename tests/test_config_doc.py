"""docs/config.md is generated from the dataclasses and must match them."""

from dflash_common.config import iter_fields
from dflash_common.config_doc import DOC, STAGES, render, stage_class


def test_reference_is_current():
    assert DOC.read_text() == render(), "docs/config.md is out of date: python -m dflash_common.config_doc"


def test_every_field_is_documented_with_help():
    text = render()
    for _, _, spec in STAGES:
        for key, _, _, help in iter_fields(stage_class(spec)):
            assert help.strip(), f"{spec} field {key} has no help text"
            assert f"`{key}`" in text
