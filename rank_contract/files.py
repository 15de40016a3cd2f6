"""Files in folders a job's ranks can write, opened as hostile input: no link followed, regular files only.

A rank owns its run directory, the job's checkpoints and outputs; the worker (root, outside the
sandbox), the API and the rank wrapper read there, and the worker writes a few files there (the
stop file, its launcher's log). Any name in such a folder may be a link (to /etc/shadow, to the
operator's environment file), a FIFO or a device, and may be swapped between any check and any
open. So each folder on the way is opened relative to the last one with O_NOFOLLOW, the last name
too (a link anywhere fails the open: ELOOP or ENOTDIR), with O_NONBLOCK (a FIFO never holds the
open); what was opened is checked on its fd (fstat), never again by its path; and readers read
within a byte bound. One module does it for every reader and writer (docs/security.md, "What a job
hands the worker"); it lives in rank_contract because the rank wrapper (workers/command/failure.py)
uses it too, and imports only the standard library.

Why not openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS): Python has no binding for it (a ctypes
call would be ours to keep working across libcs and kernels), and the walk gives the same guarantee
here: `..` is refused before anything is opened, and with no link followed the walk cannot leave
its root. The root itself is the caller's (a path the service made); only its last name is opened
without following a link.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted there must not wait for a writer (or, to write, a reader).
_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK = 1 << 20


def _parts(relative: str) -> list[str] | None:
    parts = relative.split("/") if relative else []
    if any(part in ("", ".", "..") or "\x00" in part for part in parts):
        return None
    return parts


def open_folder(root: str | os.PathLike[str], relative: str = "") -> int | None:
    """A descriptor of the folder at `relative` under `root` (`root` itself for ""), no link followed.

    The caller closes it. None if the path is malformed or missing, or names a link or no folder.
    """
    parts = _parts(relative)
    if parts is None:
        return None
    try:
        fd = os.open(root, _FOLDER)
    except OSError:
        return None
    for part in parts:
        try:
            inner = os.open(part, _FOLDER, dir_fd=fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        fd = inner
    return fd


@contextlib.contextmanager
def folder(root: str | os.PathLike[str], relative: str = "") -> Iterator[int | None]:
    """`open_folder` as a context that closes what it opened."""
    fd = open_folder(root, relative)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def names(folder_fd: int) -> list[str]:
    """The names in an open folder, sorted (empty if it cannot be listed)."""
    try:
        return sorted(os.listdir(folder_fd))
    except OSError:
        return []


def _regular(fd: int) -> int | None:
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


def open_fd_in(folder_fd: int, name: str, *, write: bool = False) -> int | None:
    """A descriptor of the regular file `name` in an open folder, no link followed; None otherwise.

    `write`: opened read-write when this process may (to truncate it), else read-only.
    """
    if name in ("", ".", "..") or "/" in name or "\x00" in name:
        return None
    for flags in (os.O_RDWR, os.O_RDONLY) if write else (os.O_RDONLY,):
        try:
            return _regular(os.open(name, flags | _FILE, dir_fd=folder_fd))
        except PermissionError:
            continue
        except OSError:
            return None
    return None


def open_in(folder_fd: int, name: str) -> BinaryIO | None:
    """The regular file `name` in an open folder, opened to read without following a link; None otherwise."""
    fd = open_fd_in(folder_fd, name)
    return os.fdopen(fd, "rb") if fd is not None else None


def open_beneath(root: str | os.PathLike[str], relative: str) -> BinaryIO | None:
    """The regular file at `relative` (a '/'-separated path) under `root`, opened without following any link.

    None if the path is malformed, missing, passes through a link or names no regular file.
    """
    parts = _parts(relative)
    if not parts:
        return None
    with folder(root, "/".join(parts[:-1])) as fd:
        return open_in(fd, parts[-1]) if fd is not None else None


def read_beneath(
    root: str | os.PathLike[str], relative: str, *, limit: int, from_end: bool = False
) -> bytes | None:
    """At most `limit` bytes of the regular file at `relative` under `root` (its last ones `from_end`).

    None where `open_beneath` finds no file.
    """
    f = open_beneath(root, relative)
    if f is None:
        return None
    with f:
        try:
            if from_end:
                f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            return f.read(limit)
        except OSError:
            return None


def read_file(path: str | os.PathLike[str], *, limit: int, from_end: bool = False) -> bytes | None:
    """`read_beneath` of a file named by its full path: its folder trusted, the file itself not."""
    path = Path(path)
    return read_beneath(path.parent, path.name, limit=limit, from_end=from_end)


def create_beneath(root: str | os.PathLike[str], relative: str, *, append: bool = True) -> BinaryIO | None:
    """The regular file at `relative` under `root`, created (0600) or opened to write, no link followed.

    Without `append` it is emptied first. None if a link, a FIFO or anything but a regular file is
    there (or on the way): the worker never writes through what a job put in its place.
    """
    parts = _parts(relative)
    if not parts:
        return None
    with folder(root, "/".join(parts[:-1])) as dir_fd:
        if dir_fd is None:
            return None
        flags = os.O_WRONLY | os.O_CREAT | _FILE | (os.O_APPEND if append else 0)
        try:
            fd = _regular(os.open(parts[-1], flags, 0o600, dir_fd=dir_fd))
        except OSError:
            return None
    if fd is None:
        return None
    if not append:
        # Emptied on the fd, once it is known to be a regular file (O_TRUNC would act before the check).
        os.ftruncate(fd, 0)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab" if append else "wb")


def touch_beneath(root: str | os.PathLike[str], relative: str) -> bool:
    """Make sure a regular file is at `relative` under `root` (created empty, 0600); False if it cannot."""
    f = create_beneath(root, relative)
    if f is None:
        return False
    f.close()
    return True


def chunks(f: BinaryIO, *, limit: int) -> Iterator[bytes]:
    """What `f` holds from its position on, in pieces of at most 1 MiB, `limit` bytes in all at most."""
    left = limit
    while left > 0 and (piece := f.read(min(_CHUNK, left))):
        left -= len(piece)
        yield piece
