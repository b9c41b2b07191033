"""What every dflash command line shares: argument parsing into a config tree, logging, and the
record of a run (resolved config, package versions, git revision) written beside its outputs.

Each CLI's `main()` is three lines: `cfg = parse_args(...)`, `setup_logging()`, `run(cfg)`.
User errors (`ConfigError`, `UserError`) end the process with one sentence and exit code 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import typing
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import tomli_w

from dflash_common.config import (
    ConfigError,
    did_you_mean,
    iter_fields,
    load_config,
    to_dict,
)
from dflash_common.errors import UserError
from dflash_common.fsutil import atomic_write_text

T = TypeVar("T")
log = logging.getLogger("dflash")


class ArgumentParser(argparse.ArgumentParser):
    """argparse as every dflash command uses it: an option is spelt out in full (argparse would take
    `--stor` for `--store` and `--overwrit` for `--overwrite` without a word: a prefix that matches
    today means something else once an option is added), and a mistyped one gets the closest real
    option (`--confg`: did you mean --config?). Subcommands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def option_names(self) -> list[str]:
        """Every long option of this parser and of its subcommands."""
        names = [o for o in self._option_string_actions if o.startswith("--")]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    names += sub.option_names() if isinstance(sub, ArgumentParser) else []
        return sorted(set(names))

    def unknown_argument(
        self, item: str, extra: str = "", more: Sequence[str] = ()
    ) -> typing.NoReturn:
        """Exit 2 naming `item`, with the closest option (or name in `more`) when one is close."""
        flag = item.split("=", 1)[0]
        known = [*self.option_names(), *more]
        hint = did_you_mean(flag, known, quote="") if flag.startswith("--") else ""
        self.error(f"unrecognized argument '{item}'{hint}{extra}")

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        found = re.fullmatch(r"unrecognized arguments: (.+)", message)
        if found:
            hints = [
                did_you_mean(a.split("=", 1)[0], self.option_names(), quote="")
                for a in found.group(1).split()
                if a.startswith("--")
            ]
            message += "".join(h for h in hints if h)
        super().error(message)


def _examples_help(examples: str) -> str:
    if not examples.strip():
        return ""
    return "examples:\n" + textwrap.indent(textwrap.dedent(examples).strip("\n"), "  ") + "\n\n"


def _fields_help(cls: type) -> str:
    lines = ["config fields (override any with --section.field=value):"]
    for key, tp, default, help in iter_fields(cls):
        lines.append(f"  --{key}=<{tp}>  (default: {default!r})")
        lines.extend("      " + line for line in textwrap.wrap(help, 90))
    return "\n".join(lines)


def parse_args(
    cls: type[T],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    shortcuts: dict[str, str] | None = None,
    repeatable: Sequence[str] = (),
    switches: dict[str, tuple[str | None, str]] | None = None,
    examples: str = "",
) -> tuple[T, argparse.Namespace]:
    """Parse `--config FILE`, shortcut flags, switches and `--section.field=value` overrides into
    `cls`.

    `shortcuts` maps a plain flag to the dotted field it sets (`{"out": "store.path"}` makes
    `--out X` mean `--store.path=X`); names in `repeatable` may be given several times and set a
    list field.
    `switches` are flags without a value, shown in the usage line: name -> (the bool field it sets
    to true, or None for one that is no config field, read from the namespace; its help).
    `examples`: command lines, shown first in --help's epilog (a docstring's indented block).
    Returns the config and the parsed namespace (for switches that are not config fields, e.g.
    --offline).
    """
    shortcuts = shortcuts or {}
    parser = ArgumentParser(
        prog=prog,
        description=description,
        epilog=_examples_help(examples) + _fields_help(cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with the run's configuration")
    for flag, key in shortcuts.items():
        if flag in repeatable:
            parser.add_argument(
                f"--{flag}", action="append", metavar="VALUE", help=f"sets {key} (repeatable)"
            )
        else:
            parser.add_argument(f"--{flag}", metavar="VALUE", help=f"sets {key}")
    for flag, (key, help) in (switches or {}).items():
        parser.add_argument(
            f"--{flag}", action="store_true", help=help + (f" (sets {key} = true)" if key else "")
        )
    return _parse(parser, cls, argv, shortcuts, repeatable, switches or {})


def _parse(parser, cls, argv, shortcuts, repeatable, switches):
    args, rest = parser.parse_known_args(argv)
    sections = {f.name for f in dataclasses.fields(cls)}
    overrides, i = [], 0
    while i < len(rest):  # accept both `--a.b=v` and `--a.b v`
        item = rest[i]
        if item.startswith("--") and "=" not in item and "." in item and i + 1 < len(rest):
            item, i = f"{item}={rest[i + 1]}", i + 1
        key = item[2:].split("=", 1)[0]
        if not (item.startswith("--") and "=" in item) or ("." not in key and key not in sections):
            # no config field (`--confg x`, `--dryrun`, `--stor=x`): most likely a mistyped option
            parser.unknown_argument(
                item,
                "; config fields are set as --section.field=value",
                [f"--{k}" for k, _, _, _ in iter_fields(cls)],
            )
        overrides.append(item)
        i += 1
    for flag, key in shortcuts.items():
        value = getattr(args, flag.replace("-", "_"))
        if value is None:
            continue
        if flag in repeatable:
            overrides.append(f"--{key}={json.dumps(list(value))}")
        else:
            overrides.append(
                f"--{key}={json.dumps(value) if not _is_toml_literal(value) else value}"
            )
    for flag, (key, _) in switches.items():
        if key and getattr(args, flag.replace("-", "_")):
            overrides.append(f"--{key}=true")
    try:
        cfg = load_config(cls, args.config, overrides)
    except ConfigError as e:
        exit_with_error(str(e))
    return cfg, args


def _is_toml_literal(value: str) -> bool:
    import tomllib

    try:
        tomllib.loads(f"v = {value}")
        return True
    except tomllib.TOMLDecodeError:
        return False


def exit_with_error(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def user_errors_exit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for CLI mains: ConfigError/UserError become one line on stderr and exit code 2; a
    closed stdout pipe (`| head`) ends quietly with 141."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
            sys.stdout.flush()  # inside the try: a closed pipe is met here, not at interpreter exit
            return result
        except (ConfigError, UserError) as e:
            exit_with_error(str(e))
        except BrokenPipeError:  # `| head` closed stdout: stop quietly, as cat does
            # the exit flush has nowhere to fail
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(141)  # 128 + SIGPIPE, what a shell reports for a reader that went away

    return wrapper


INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


@contextlib.contextmanager
def interrupt_says(sentence: Callable[[], str]) -> Iterator[None]:
    """Ctrl-C (KeyboardInterrupt) inside the block ends the process with `interrupted: <sentence>`
    (what was kept, how to resume) and exit code 130, not a traceback. Whatever the block holds is
    released by its own `finally`s first, so what is on disk is what a kill would leave, or less."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"interrupted: {sentence()}", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_EXIT)


def shards_kept(out: Any) -> str:
    """What a stage that publishes shards keeps when interrupted (`interrupt_says`' sentence for
    dflash-generate and dflash-precompute)."""
    return (
        f"the shards already published in {out} are kept (a shard being written is not visible); "
        "rerun the same command to resume."
    )


def progress_bar(iterable: Any = None, *, enabled: bool = True, **kwargs: Any) -> Any:
    """A tqdm bar that draws only on a terminal: tqdm's `disable=None` switches it off when its
    stream (stderr) is not a tty (CI, `| tee`, nohup), where every frame would be one more line of
    noise; the log lines and the final summary say what the bar would have."""
    from tqdm import tqdm

    return tqdm(iterable, disable=None if enabled else True, **kwargs)


class RateBar:
    """A `progress_bar` of things done (samples, turns) with the rate of tokens they make, for a job
    of ranks (drawn where `enabled`: rank 0; on a terminal only). It counts whether it draws or not.

        with RateBar(total, unit="sample", desc="precompute", enabled=ranks.main) as bar:
            bar.update(done=8, tokens=4096)      # or bar.add_tokens(n) as they come, bar.update(1)
    """

    def __init__(
        self,
        total: int,
        *,
        unit: str,
        desc: str,
        enabled: bool = True,
        rate: str = "tok/s",
        note: Callable[[], str] | None = None,
    ):
        self.total, self.unit, self.desc, self.enabled = total, unit, desc, enabled
        self.rate, self.note = rate, note  # the rate's name; `note()`: more text after it
        self.bar: Any = None
        self.done = self.tokens = 0
        self.started = time.perf_counter()

    def __enter__(self) -> "RateBar":
        if self.enabled:
            self.bar = progress_bar(
                total=self.total, unit=self.unit, desc=self.desc, dynamic_ncols=True
            )
        return self

    def add_tokens(self, n: int) -> None:
        self.tokens += n

    def update(self, done: int, tokens: int = 0) -> None:
        self.done += done
        self.tokens += tokens
        if self.bar is not None:
            rate = self.tokens / max(1e-9, time.perf_counter() - self.started)
            note = f", {self.note()}" if self.note is not None else ""
            self.bar.set_postfix_str(f"{rate:,.0f} {self.rate}{note}", refresh=False)
            self.bar.update(done)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def library_bars_follow_the_terminal() -> None:
    """The bars of transformers and huggingface_hub (e.g. 'Loading weights') follow `progress_bar`'s
    rule: none when stderr is not a terminal. The environment variable covers libraries imported
    later."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def setup_logging(level: int = logging.INFO) -> None:
    """Log lines on stderr (with the rank under torchrun); library progress bars only on a
    terminal."""
    library_bars_follow_the_terminal()
    rank = os.environ.get("RANK")
    prefix = (
        f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    )
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {prefix}%(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def package_versions() -> dict[str, str]:
    names = [
        "dflash",
        "torch",
        "triton",
        "transformers",
        "zarr",
        "numcodecs",
        "torchdata",
        "safetensors",
    ]
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_revision() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if rev.returncode != 0:
        return None
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def run_record(cfg: Any) -> dict[str, Any]:
    """What a run was: its resolved config, the package versions and the code revision."""
    return {
        "config": to_dict(cfg),
        "versions": package_versions(),
        "git_revision": git_revision(),
        "argv": sys.argv,
    }


def write_run_record(
    directory: str | Path, cfg: Any, name: str = "run", extra: dict[str, Any] | None = None
) -> None:
    """Write `<name>.toml` (the resolved config, loadable with --config) and `<name>.json`
    (versions, and `extra`: what else the stage records, e.g. a training run's resumes)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    record = {**run_record(cfg), **(extra or {})}
    atomic_write_text(directory / f"{name}.toml", tomli_w.dumps(record["config"]))
    atomic_write_text(directory / f"{name}.json", json.dumps(record, indent=2, default=str))
