"""One job per directory: an OS lock on a hidden file inside a run directory or a store.

`flock()` locks die with their process (a SIGKILL included), so a killed job never leaves a stale
lock and the next run needs no cleanup. Only one process of a torchrun job takes the lock (rank 0,
the caller decides): the ranks of one job share its directory, two unrelated jobs conflict. The
holder writes its pid and host into the file, so the second job's sentence can name it.

Readers ignore hidden names, so the lock file is invisible to the store and checkpoint formats.
A job refused before it wrote anything can leave nothing behind (`tidy`): it removes the lock file
while still holding it, and a job that opened the file meanwhile finds it gone and takes a new one.
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
def hold_directory(directory: str | Path, what: str, fix: str, *,
                   tidy: bool = False) -> Iterator[Path]:
    """Hold `directory/.dflash.lock` exclusively while the block runs; if another process holds it,
    raise one sentence: `<what> <dir> is in use by another job (<pid ...>); <fix>.`

    With `tidy`, a job that leaves the directory holding nothing but the lock (it was refused before
    it wrote anything) leaves nothing it created: the lock file, and the directory and its parents
    if this call made them."""
    directory = Path(directory)
    path = directory / LOCK_FILE
    while True:
        created = [p for p in [directory, *directory.parents] if not p.exists()]  # deepest first
        directory.mkdir(parents=True, exist_ok=True)
        lock_existed = path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"{what} {directory} is in use by another job ({_holder(path)}); "
                            f"{fix}.") from None
        if _still_named(fd, path):
            break
        os.close(fd)  # the file was removed (tidied) between our open and lock: take a new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield path
    finally:
        if tidy:
            _remove_if_unused(directory, path, [] if lock_existed else [path], created)
        os.close(fd)  # releases the lock; the file stays unless tidied above, under the lock


def _still_named(fd: int, path: Path) -> bool:
    """Whether `path` is still the file `fd` locked (not removed, nor replaced, before the lock)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _remove_if_unused(directory: Path, lock: Path, files: list[Path], dirs: list[Path]) -> None:
    """Remove `files` and then `dirs` (deepest first) if `directory` holds nothing but the lock. The
    lock is still held: a job that opened the file meanwhile fails to lock it, or finds it gone
    once it has (`_still_named`) and takes a new one."""
    try:
        if any(p.name != LOCK_FILE for p in directory.iterdir()):
            return
        for path in files:
            path.unlink(missing_ok=True)
        for path in dirs:
            path.rmdir()
    except OSError:  # something else appeared, or a directory is not ours to remove: leave the rest
        pass
