"""Files the service and its workers create are their owner's alone (docs/security.md).

The database and its WAL, the broker's queue file, checkpoints, code archives, run directories and
token files hold secrets or users' work; other local accounts must not read them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from sqlalchemy.engine import make_url

# Every file a job's ranks could have put in place is opened by rank_contract.files (no link
# followed, regular files only); the outputs scanner and the downloads reach it through here.
from rank_contract.files import open_beneath as open_beneath

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
