"""dflash_common/cli.py: progress bars draw only on a terminal; switches appear in the usage line."""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest

from dflash_common.cli import parse_args, progress_bar
from dflash_common.config import option, section


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_bar_draws_frames_on_a_terminal_and_nothing_elsewhere():
    tty, pipe = _Terminal(), io.StringIO()
    for stream in (tty, pipe):
        assert list(progress_bar(range(3), file=stream, mininterval=0, desc="x")) == [0, 1, 2]
    assert "\r" in tty.getvalue() and "3/3" in tty.getvalue()
    assert pipe.getvalue() == ""  # CI, `| tee`, nohup: not one frame
    off = _Terminal()
    list(progress_bar(range(3), enabled=False, file=off))
    assert off.getvalue() == ""


@dataclass(frozen=True)
class _Run:
    dry_run: bool = option(False, "Stop after the plan.")


@dataclass(frozen=True)
class _Cfg:
    run: _Run = section(_Run, "Run.")


def test_switches_set_their_field_and_show_in_the_usage_line(capsys):
    switches = {"dry-run": ("run.dry_run", "print the plan"), "offline": (None, "no target")}
    cfg, args = parse_args(_Cfg, ["--dry-run"], prog="p", description="d", switches=switches)
    assert cfg.run.dry_run and not args.offline
    cfg, args = parse_args(_Cfg, ["--offline"], prog="p", description="d", switches=switches)
    assert not cfg.run.dry_run and args.offline
    with pytest.raises(SystemExit):
        parse_args(_Cfg, ["--help"], prog="p", description="d", switches=switches)
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert "[--dry-run]" in usage and "[--offline]" in usage
