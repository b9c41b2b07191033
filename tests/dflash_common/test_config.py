from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest

from dflash_common.config import ConfigError, check, iter_fields, load_config, option, section, to_dict


@dataclass(frozen=True)
class Inner:
    lr: float = option(6e-4, "Peak learning rate.")
    layer_ids: list[int] | None = option(None, "Target layer ids; none means the DFlash default.")
    dtype: Literal["bf16", "fp8_e4m3"] = option("bf16", "Storage dtype.")

    def __post_init__(self):
        check(self.lr > 0, f"inner.lr must be > 0, got {self.lr}")


@dataclass(frozen=True)
class Outer:
    name: str = option("run", "Run name.")
    steps: int = option(10, "Steps.")
    flag: bool = option(False, "A switch.")
    inner: Inner = section(Inner, "Inner section.")


def test_defaults_toml_and_overrides_layer_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('name = "x"\n[inner]\nlr = 1e-3\nlayer_ids = [1, 9]\n')
    cfg = load_config(Outer, path, ["--inner.lr=3e-4", "--steps=7", "--flag=true", "--inner.dtype=fp8_e4m3"])
    assert cfg == Outer(name="x", steps=7, flag=True, inner=Inner(lr=3e-4, layer_ids=[1, 9], dtype="fp8_e4m3"))
    assert load_config(Outer, None, ["--inner.layer_ids=1,2,3"]).inner.layer_ids == [1, 2, 3]
    assert load_config(Outer, None, ["--name=123"]).name == "123"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("--inner.lrr=1", "inner.lrr"),
        ("--nope=1", "'nope'"),
        ("--steps=abc", "steps"),
        ("--steps=1.5", "steps"),
        ("--inner.dtype=fp16", "inner.dtype"),
        ("--inner.lr=-1", "inner.lr must be > 0"),
        ("--flag=maybe", "flag"),
        ("--inner.layer_ids=1,x", "inner.layer_ids[1]"),
        ("steps=3", "--section.field=value"),
    ],
)
def test_bad_keys_and_values_are_one_sentence_naming_the_key(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(Outer, None, [override])
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Outer, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(Outer, bad)


def test_frozen_and_round_trip():
    cfg = load_config(Outer, None, ["--inner.layer_ids=[1,2]"])
    with pytest.raises(AttributeError):
        cfg.steps = 3  # type: ignore[misc]
    again = load_config(Outer, None, [f"--{k}={v!r}".replace("'", '"') for k, v in _flat(to_dict(cfg))])
    assert again == cfg


def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + k + ".")
        else:
            yield prefix + k, (str(v).lower() if isinstance(v, bool) else v)


def test_every_field_has_help():
    keys = {k: h for k, _, _, h in iter_fields(Outer)}
    assert set(keys) == {"name", "steps", "flag", "inner.lr", "inner.layer_ids", "inner.dtype"}
    assert all(keys.values())


@dataclass(frozen=True)
class Staged(Outer):
    STAGE: ClassVar[str] = "train"


def test_an_override_prefixed_with_the_stage_table_gets_the_hint_to_drop_it():
    with pytest.raises(ConfigError) as caught:
        load_config(Staged, None, ["--train.inner.lr=3e-4"])
    message = str(caught.value)
    assert "names the [train] table" in message and "drop 'train.': --inner.lr=3e-4" in message
    assert load_config(Staged, None, ["--inner.lr=3e-4"]).inner.lr == 3e-4


def test_an_unknown_key_in_a_toml_file_names_the_file_and_the_line(tmp_path):
    staged = tmp_path / "stages.toml"
    staged.write_text('# a file of stage tables\n[train]\nname = "x"\n\n[train.inner]\nlr = 1e-3\nlrr = 2\n'
                      '[eval.inner]\nlrr = 3\n')
    plain = tmp_path / "plain.toml"
    plain.write_text('steps = 3\n# a dotted key\n  inner.dtyp = "bf16"\n')
    inline = tmp_path / "inline.toml"
    inline.write_text('steps = 3\ninner = { lr = 1e-3, lrr = 2 }\n')
    section_typo = tmp_path / "typo.toml"
    section_typo.write_text('steps = 3\n\n[innr]\nlr = 1e-3\n')
    hint = "(did you mean '{}'?);"
    cases = [(Staged, staged, f"Unknown config key 'lrr' in table [train.inner] of {staged}, "
              "line 7 " + hint.format("lr")),
             (Outer, plain, f"Unknown config key 'dtyp' in table [inner] of {plain}, line 3 "
              + hint.format("dtype")),
             (Outer, inline, f"Unknown config key 'lrr' in table [inner] of {inline}, line 2 "
              + hint.format("lr")),
             (Outer, section_typo, f"Unknown config key 'innr' at the top level of {section_typo}, "
              "line 3 " + hint.format("inner"))]
    for cls, path, start in cases:
        with pytest.raises(ConfigError) as caught:
            load_config(cls, path)
        assert str(caught.value).startswith(start), str(caught.value)
        assert "known keys there:" in str(caught.value)
    ok = tmp_path / "ok.toml"  # a key from the command line is not blamed on the file
    ok.write_text("steps = 3\n")
    with pytest.raises(ConfigError) as caught:
        load_config(Outer, ok, ["--inner.lrx=1"])
    assert str(ok) not in str(caught.value) and "inner.lrx" in str(caught.value)


def test_every_stage_takes_the_device_names_the_ranks_resolve():
    from dflash_common.config import check_device
    from precompute.config import PrecomputeConfig
    from precompute.generate.config import GenerateConfig
    from train.config import TrainConfig
    from train.eval.config import EvalConfig

    for device in ("auto", "cpu", "cuda", "cuda:1"):
        check_device(device, "run.device")
    for device in ("gpu", "cuda:", "cudax", "cuda:one"):
        with pytest.raises(ConfigError, match=rf"^run.device = '{device}' must be 'auto', 'cpu'"):
            check_device(device, "run.device")
    with pytest.raises(ConfigError, match="must be 'auto', 'cpu' or 'cuda'.$"):
        check_device("cuda:1", "run.device", index=False)  # train: each rank takes its own GPU
    for cls, key in ((PrecomputeConfig, "run.device"), (GenerateConfig, "run.device"),
                     (TrainConfig, "run.device"), (EvalConfig, "target.device")):
        with pytest.raises(ConfigError, match=f"^{key} = 'gpu'"):
            load_config(cls, None, [f"--{key}=gpu"])
