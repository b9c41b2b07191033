"""One job per directory: an OS lock on a hidden file inside a run directory or a store.

`flock()` locks die with their process (a SIGKILL included), so a killed job never leaves a stale
lock and the next run needs no cleanup. Only one process of a torchrun job takes the lock (rank 0,
the caller decides): the ranks of one job share its directory, two unrelated jobs conflict. The
holder writes its pid and host into the file, so the second job's sentence can name it.

Readers ignore hidden names, so the lock file is invisible to the store and checkpoint formats.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path
from typing import Iterator

from dflash_common.errors import UserError

LOCK_FILE = ".dflash.lock"


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text or "unknown"


@contextlib.contextmanager
def hold_directory(directory: str | Path, what: str, fix: str) -> Iterator[Path]:
    """Hold `directory/.dflash.lock` exclusively while the block runs; if another process holds it,
    raise one sentence: `<what> <dir> is in use by another job (<pid ...>); <fix>.`"""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{what} {directory} is in use by another job ({_holder(path)}); {fix}.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race a new holder)
