"""dflash_common/cli.py: progress bars draw only on a terminal; switches appear in the usage line."""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass

import pytest

from dflash_common.cli import RateBar, parse_args, progress_bar
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


def test_a_rate_bar_counts_and_shows_the_rate_and_its_note(monkeypatch):
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)  # tqdm's stream
    bar = RateBar(4, unit="turn", desc="generate", rate="generated tok/s", note=lambda: "1 MiB out")
    with bar:
        bar.add_tokens(100)
        bar.update(1)
        bar.update(3, tokens=50)
    assert (bar.done, bar.tokens) == (4, 150)
    assert "generate" in tty.getvalue() and "4/4" in tty.getvalue()
    assert "generated tok/s, 1 MiB out" in tty.getvalue()
    off = RateBar(2, unit="x", desc="x", enabled=False)  # not rank 0: counts, draws nothing
    with off:
        off.update(2, tokens=10)
    assert off.bar is None and (off.done, off.tokens) == (2, 10)


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
