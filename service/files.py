"""Files the service and its workers create are their owner's alone (docs/security.md).

The database and its WAL, the broker's queue file, checkpoints, code archives, run directories and
token files hold secrets or users' work; other local accounts must not read them.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.engine import make_url

# No group or other bits on anything a server process creates: files 0600, folders 0700. The
# ranks, started by the worker, inherit it.
PRIVATE_UMASK = 0o077


def private_umask() -> int:
    """Make every file this process creates from now on private (umask 077); returns the previous umask."""
    return os.umask(PRIVATE_UMASK)


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only, whatever the umask (a token file)."""
    # Created 0600 by open(2) itself, never readable by others for a moment; an existing file (an older
    # release wrote it 0644) is narrowed before anything is written into it.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def create_private_sqlite(url: str) -> None:
    """Create the file of a SQLite URL 0600 if it does not exist, so SQLite's WAL and shm files follow."""
    # SQLite creates its -wal, -shm and -journal files with the mode of the database file, so a
    # database created private keeps its journal private too, whichever process opens it first.
    # kombu's SQLAlchemy transport names its database `sqla+<SQLAlchemy URL>`.
    parsed = make_url(url.removeprefix("sqla+"))
    if not parsed.get_backend_name().startswith("sqlite"):
        return
    database = parsed.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database)
    if path.exists() or not path.parent.is_dir():
        return  # an operator's own file keeps its mode; a missing folder is SQLite's error to report
    # FileExistsError: another process of the service created it a moment ago, with the same mode.
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def open_beneath(root: Path, relative: str) -> BinaryIO | None:
    """The regular file at `relative` (a '/'-separated path) under `root`, opened without following any link.

    Every folder on the way is opened relative to the last one with O_NOFOLLOW, so a link planted
    anywhere on the path (by a job's ranks, which may swap one in after any earlier check) is refused,
    never followed out of `root`. None if the path is malformed, missing or not a regular file.
    """
    parts = relative.split("/")
    if any(part in ("", ".", "..") or "\x00" in part for part in parts):
        return None
    folder_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        fd = os.open(root, folder_flags)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            inner = os.open(part, folder_flags, dir_fd=fd)
            os.close(fd)
            fd = inner
        # O_NONBLOCK: opening a FIFO planted there must not wait for a writer.
        file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        return None
    return os.fdopen(file_fd, "rb")
