"""Typed, frozen configuration trees loaded from TOML with command-line overrides.

Every stage (precompute, train, eval) has one tree of frozen dataclasses. Defaults live in the
dataclass and nowhere else; a TOML file in `configs/` sets some of them; `--section.field=value` on
the command line sets any of them last. Help text comes from each field's `help` metadata, so the CLI
`--help`, the generated configuration reference (docs/config.md) and the code cannot drift apart.

    @dataclass(frozen=True)
    class OptimSection:
        lr: float = option(6e-4, "Peak learning rate of AdamW.")

    cfg = load_config(TrainConfig, "configs/tiny.toml", ["--optim.lr=3e-4"])

Errors a user can cause (unknown key, wrong type, value out of range) raise `ConfigError` with one
sentence that names the offending key.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key a user wrote is wrong; the message names it."""


class UnknownKeyError(ConfigError):
    """A key the config tree does not have: `key` is its dotted path, `known` the keys of its section."""

    def __init__(self, message: str, key: str, known: list[str]):
        super().__init__(message)
        self.key = key
        self.known = known


def closest(word: str, candidates: typing.Iterable[str]) -> str | None:
    """The candidate a mistyped `word` most likely meant (difflib's ratio >= 0.6), or None."""
    found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(word: str, candidates: typing.Iterable[str], quote: str = "'") -> str:
    """' (did you mean 'x'?)' for the closest candidate, or '' when none is close."""
    match = closest(word, candidates)
    return f" (did you mean {quote}{match}{quote}?)" if match else ""


def corrected_key(cls: type, dotted: str) -> str | None:
    """`dotted` with each unknown part replaced by the closest key of its section (`optm.lrr` ->
    `optim.lr`), if every part finds one; None when none is needed or some part finds none."""
    parts, out, node = dotted.split("."), [], cls
    for part in parts:
        if node is None:
            return None
        names = {f.name: f for f in dataclasses.fields(node)}
        name = part if part in names else closest(part, names)
        if name is None:
            return None
        out.append(name)
        tp = _hints(node)[name]
        node = tp if _is_section(tp) else None
    fixed = ".".join(out)
    return fixed if fixed != dotted else None


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with help text. Mutable defaults (lists) are copied per instance."""
    metadata = {"help": help}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def section(cls: type, help: str) -> Any:
    """A nested config section whose defaults are those of `cls`."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    if origin is dict:
        return "table"
    return "none" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and where lossless, convert) a TOML value against a field type."""
    origin = get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        errors = []
        for arm in get_args(tp):
            try:
                return _coerce(value, arm, key)
            except ConfigError as e:
                errors.append((arm, e))
        real = [e for arm, e in errors if arm is not type(None)]
        if len(real) == 1:  # Optional[X]: the error of X says more than "not a valid X | none"
            raise real[0]
        raise ConfigError(f"{key} = {value!r} is not a valid {_type_name(tp)}.")
    if tp is type(None):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        raise ConfigError(f"{key} = {value!r} is not none.")
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"{key} = {value!r} must be one of {', '.join(repr(a) for a in get_args(tp))}.")
    if origin is list:
        if isinstance(value, str):  # `--x=1,2,3` on the command line
            value = [v for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r} must be a list.")
        (item_tp,) = get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r} must be a table.")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key} = {value!r} must be true or false.")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} must be an integer.")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key} = {value!r} must be an integer.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} = {value!r} must be a number.")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} = {value!r} must be a string.")
    raise TypeError(f"config field {key} has a type the loader does not know: {tp!r}")


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build a config tree from nested dicts, refusing unknown keys and values of the wrong type."""
    if not isinstance(data, dict):
        raise ConfigError(f"[{prefix.rstrip('.')}] must be a table, not {data!r}.")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"section [{prefix.rstrip('.')}]" if prefix else "the top level"
            hint, known = did_you_mean(key, names), ", ".join(sorted(names))
            raise UnknownKeyError(
                f"Unknown config key '{prefix}{key}' in {where}{hint}; known keys: {known}.",
                prefix + key, sorted(names))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp, key = hints[f.name], prefix + f.name
        if _is_section(tp):
            kwargs[f.name] = from_dict(tp, data[f.name], key + ".")
        else:
            kwargs[f.name] = _coerce(data[f.name], tp, key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a __post_init__ check
        raise ConfigError(str(e)) from e


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config tree as nested plain dicts (None values dropped, as TOML has no null)."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif value is not None:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`--a.b=value` -> (["a", "b"], value); the value is read as TOML where it parses, else a string."""
    if not text.startswith("--") or "=" not in text:
        raise ConfigError(f"Override '{text}' must look like --section.field=value.")
    key, raw = text[2:].split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def merge_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"Override '--{'.'.join(path)}' goes through '{part}', which is not a section.")
    node[path[-1]] = value


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file {path} does not exist; pass an existing TOML file to --config.")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"Config file {path} is not valid TOML ({e}); fix the file.") from e


# The stages a config file may hold side by side ([precompute.target], [train.optim], ...): one file
# can then describe a whole experiment (configs/tiny.toml), each CLI reading its own table.
STAGES = ("generate", "precompute", "train", "eval")


def stage_table(cls: type, data: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """`data` itself for a one-stage file; the table of `cls.STAGE` for a file made of stage tables."""
    stage = getattr(cls, "STAGE", None)
    if stage is None or not data or not set(data) <= set(STAGES):
        return data
    if stage not in data:
        raise ConfigError(f"Config file {path} holds the stages {sorted(data)} but no [{stage}] table; add one "
                          f"or pass a {stage} config.")
    return data[stage]


def load_config(cls: type[T], path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> T:
    """Defaults <- TOML file (its `[<stage>]` table when it holds several stages) <- `--section.field=value`
    overrides, validated into a frozen tree."""
    whole = read_toml(path) if path is not None else {}
    data = stage_table(cls, whole, path) if path is not None else {}
    set_by_overrides = []
    for text in overrides:
        keys, value = parse_override(text)
        _refuse_stage_prefix(cls, keys, text.split("=", 1)[1])
        merge_override(data, keys, value)
        set_by_overrides.append(".".join(keys))
    try:
        return from_dict(cls, data)
    except UnknownKeyError as e:
        typed = [k for k in set_by_overrides if k == e.key or k.startswith(e.key + ".")]
        if typed:
            raise _unknown_override(cls, typed[0], e) from e
        if path is None:
            raise
        in_file = (f"{cls.STAGE}.{e.key}" if data is not whole else e.key)  # type: ignore[attr-defined]
        line = toml_key_line(Path(path).read_text(), in_file)
        where = f"{path}" + (f", line {line}" if line else "")
        table = in_file.rsplit(".", 1)[0] if "." in in_file else None
        name = in_file.rsplit(".", 1)[-1]
        raise ConfigError(f"Unknown config key '{name}' "
                          + (f"in table [{table}] " if table else "at the top level ")
                          + f"of {where}{did_you_mean(name, e.known)}; known keys there: "
                          + f"{', '.join(e.known)}.") from e


def _unknown_override(cls: type, typed: str, error: UnknownKeyError) -> ConfigError:
    """An unknown key set on the command line: the whole override corrected where it can be
    (`--optm.lr` -> `--optim.lr`), else the keys of the section it goes wrong in."""
    fixed = corrected_key(cls, typed)
    hint = f" (did you mean --{fixed}?)" if fixed else ""
    where = f"section [{error.key.rsplit('.', 1)[0]}]" if "." in error.key else "the top level"
    return ConfigError(f"Unknown config key '{error.key}' in --{typed}{hint}; known keys of "
                       f"{where}: {', '.join(error.known)}.")


def _refuse_stage_prefix(cls: type, keys: list[str], raw_value: str) -> None:
    """`--train.optim.lr=...` names the TOML table of the stage; on its own command line the stage's
    fields are set without it."""
    stage = getattr(cls, "STAGE", None)
    names = {f.name for f in dataclasses.fields(cls)}
    if stage and len(keys) > 1 and keys[0] == stage and stage not in names:
        rest = ".".join(keys[1:])
        raise ConfigError(f"Override '--{'.'.join(keys)}' names the [{stage}] table of a config file, but the "
                          f"command line sets the fields of that table directly; drop '{stage}.': --{rest}={raw_value}")


_TOML_KEY_PART = r'(?:[A-Za-z0-9_-]+|"[^"]*"|\'[^\']*\')'
_TOML_TABLE = re.compile(r"^\[\[?\s*(" + _TOML_KEY_PART + r"(?:\s*\.\s*" + _TOML_KEY_PART + r")*)\s*\]\]?")
_TOML_ASSIGN = re.compile(r"^(" + _TOML_KEY_PART + r"(?:\s*\.\s*" + _TOML_KEY_PART + r")*)\s*=")


def _toml_key_parts(text: str) -> list[str]:
    return [a or b or c for a, b, c in re.findall(r'"([^"]*)"|\'([^\']*)\'|([A-Za-z0-9_-]+)', text)]


def toml_key_line(text: str, dotted: str) -> int | None:
    """The line (1-based) of a TOML text that sets the key `dotted` (`train.optim.lrr`): a table header
    `[train.optim]` followed by `lrr = ...`, a dotted key, or a header of that table. tomllib keeps no
    positions, so the text is scanned; a line that sets only a table around the key (an inline table)
    is the answer when nothing sets the key itself; None when no line does."""
    target = dotted.split(".")
    table: list[str] = []
    around = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        header, assign = _TOML_TABLE.match(line), _TOML_ASSIGN.match(line)
        if header:
            table = _toml_key_parts(header.group(1))
            full = table
        elif assign:
            full = table + _toml_key_parts(assign.group(1))
        else:
            continue
        if full[: len(target)] == target:
            return number
        if assign and around is None and full == target[: len(full)]:
            around = number
    return around


def iter_fields(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, str, Any, str]]:
    """(dotted key, type name, default, help) for every leaf field, depth first."""
    hints = _hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            yield from iter_fields(tp, prefix + f.name + ".")
        else:
            yield prefix + f.name, _type_name(tp), getattr(defaults, f.name), f.metadata.get("help", "")


def check(condition: bool, message: str) -> None:
    """For __post_init__: raise ConfigError(message) unless condition holds."""
    if not condition:
        raise ConfigError(message)


def check_device(device: str, field: str, index: bool = True) -> None:
    """For __post_init__: `device` is a name dflash_common.dist.resolve_device takes: 'auto', 'cpu',
    'cuda' and, where `index`, 'cuda:N'."""
    names = "'auto', 'cpu' or 'cuda[:N]'" if index else "'auto', 'cpu' or 'cuda'"
    indexed = index and re.fullmatch(r"cuda:\d+", device) is not None
    ok = device in ("auto", "cpu", "cuda") or indexed
    check(ok, f"{field} = {device!r} must be {names}.")
