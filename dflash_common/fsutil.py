"""Filesystem helpers for the promise that nothing half-written is ever visible.

Write aside under a hidden temporary name, fsync, then publish with one atomic rename; fsync the
parent directory so the rename itself survives a crash.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from dflash_common.errors import UserError


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_sibling(path: str | Path) -> Path:
    """A hidden name beside `path`, unique per process and call (readers skip names starting with '.')."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write_bytes(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` so a reader sees the old file or the new one, never a part."""
    path = Path(path)
    tmp = temp_sibling(path)
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str, *, durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), durable=durable)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and directory below `root` (before publishing it with a rename)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def publish_dir(tmp: str | Path, final: str | Path) -> bool:
    """Atomically rename a finished directory into place; False if `final` already exists (someone
    else published the same work first; `tmp` is removed)."""
    tmp, final = Path(tmp), Path(final)
    try:
        os.rename(tmp, final)  # fails on a non-empty existing directory: the first writer wins
    except OSError:
        if final.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        raise
    fsync_dir(final.parent)
    return True


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it came from, says the filesystem is full or over quota. Not every
    library raises OSError(ENOSPC): safetensors raises SafetensorError('... No space left on device
    (os error 28)')."""
    seen = 0
    while error is not None and seen < 8:  # a chain of causes; never loops on a cycle
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(error) for text in ("No space left on device", "Disk quota exceeded")):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def os_reason(error: BaseException) -> str:
    """The OS's words for an error ('No space left on device'), without the errno and the file name
    (which would name a hidden temporary file); else the error's first line."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def nearest_existing(path: str | Path) -> Path:
    """`path` if it exists, else its nearest ancestor that does (where a `mkdir -p` starts)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def first_missing(path: str | Path) -> Path | None:
    """The top directory `mkdir -p path` creates (what to remove to undo it); None if it exists."""
    path = Path(path)
    if path.exists():
        return None
    while not path.parent.exists() and path.parent != path:
        path = path.parent
    return path


def check_writable(path: str | Path, what: str, fix: str, *, directory: bool = True,
                   beside: bool = False) -> None:
    """Refuse, in one sentence, an output a job could not write, before the job does any work.

    `directory=True`: the job writes inside `path` (created if missing), and with `beside` also
    next to it (a run record, a cache); False: it creates or replaces the entry `path` itself (a
    file, or a directory renamed into place), so its parent is what must be writable. Refused: a
    file where a directory has to be, and a read-only filesystem, an immutable directory or missing
    permission at the nearest existing level. That is found by creating and removing a hidden file
    there: the mode bits do not tell (root ignores them; a read-only mount or an immutable flag
    does not show in them)."""
    path = Path(path)
    places = [path] if directory else []
    places += [path.parent] if beside or not directory else []
    for place in dict.fromkeys(nearest_existing(p) for p in places):
        if not place.is_dir():
            detail = ("is a file, not a directory" if place == path
                      else f"cannot be created: {place} is a file")
            raise UserError(f"{what} {path} {detail}; {fix}.")
        try:
            fd, probe = tempfile.mkstemp(prefix=".dflash-write-check-", dir=place)
        except OSError as e:
            at = "" if place == path else f" at {place}"
            reason = f"{os_reason(e)}{at}"
            raise UserError(f"{what} {path} cannot be written ({reason}); {fix}.") from None
        os.close(fd)
        os.unlink(probe)


def human_bytes(n: float) -> str:
    """Bytes in binary units (KiB = 1024 B), the one unit system of every size dflash prints."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
