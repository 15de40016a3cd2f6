"""Migrated test databases cloned from one template instead of replaying every migration each time.

PostgreSQL: `CREATE DATABASE x TEMPLATE t` copies a database that the migrations built once. The
template's name carries a hash of migrations/, so a changed or added migration builds a new template
and no run clones a stale schema. Every process that clones (each pytest-xdist worker, other
checkouts on the same server) goes through one advisory lock, so a template is built once, and holds
a shared advisory lock on its own template while it runs, so that a run with other migrations drops
only the templates nobody is cloning from. SQLite: each process migrates one file and copies it.

Nothing connects to a template: PostgreSQL refuses to clone a database someone is connected to.
tests/test_db.py keeps one test that replays the migrations on an empty database of each kind.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import shutil
import sqlite3
import tempfile
from pathlib import Path

from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from migrations import MIGRATIONS_DIR, upgrade

TEMPLATE_PREFIX = "dptrain_template_"
# Held by whoever builds a template or drops stale ones: one at a time on the whole server.
BUILD_LOCK = int.from_bytes(hashlib.sha256(b"dptrain test templates").digest()[:7], "big")


def migrations_digest() -> str:
    """A short hash of every Python file under migrations/ (the versions and the environment they run in)."""
    digest = hashlib.sha256()
    for path in sorted(MIGRATIONS_DIR.rglob("*.py")):
        digest.update(str(path.relative_to(MIGRATIONS_DIR)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _in_use_lock(template: str) -> int:
    """The advisory lock key that a run using `template` holds shared while it runs."""
    return int.from_bytes(hashlib.sha256(template.encode()).digest()[:7], "big")


def _database_url(admin_url: str, name: str) -> str:
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def _exists(conn: Connection, name: str) -> bool:
    return conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first() is not None


@functools.cache
def pg_template(admin_url: str) -> str:
    """The name of the migrated template database for the current migrations, built if nobody has yet."""
    template = f"{TEMPLATE_PREFIX}{migrations_digest()}"
    building = f"{template}_building"
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    # This connection holds the process's shared lock on its template until the process ends.
    conn = engine.connect()
    atexit.register(engine.dispose)
    atexit.register(conn.close)
    conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": BUILD_LOCK})
    try:
        conn.execute(text("SELECT pg_advisory_lock_shared(:k)"), {"k": _in_use_lock(template)})
        if not _exists(conn, template):
            # Built under another name and renamed when complete: a run killed half-way leaves no
            # template that looks finished (the next builder drops what it left).
            conn.execute(text(f'DROP DATABASE IF EXISTS "{building}" WITH (FORCE)'))
            conn.execute(text(f'CREATE DATABASE "{building}"'))
            upgrade(_database_url(admin_url, building))
            conn.execute(text(f'ALTER DATABASE "{building}" RENAME TO "{template}"'))
        _drop_stale(conn, keep=template)
    finally:
        conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": BUILD_LOCK})
    return template


def _drop_stale(conn: Connection, *, keep: str) -> None:
    """Drop the templates of other migrations that no running test session holds (caller holds BUILD_LOCK)."""
    names = conn.execute(
        text("SELECT datname FROM pg_database WHERE datname LIKE :p AND datname <> :keep"),
        {"p": TEMPLATE_PREFIX.replace("_", r"\_") + "%", "keep": keep},
    ).scalars()
    for name in list(names):
        if name.endswith("_building"):  # its builder died: a live one would hold BUILD_LOCK
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            continue
        key = _in_use_lock(name)
        if conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar_one():
            try:
                # Someone connected by hand keeps it: a later run drops it.
                with contextlib.suppress(DBAPIError):
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})


def clone_pg_template(admin_url: str, name: str) -> str:
    """Create database `name` as a copy of the migrated template; its URL."""
    template = pg_template(admin_url)
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
    finally:
        admin.dispose()
    return _database_url(admin_url, name)


@functools.cache
def _sqlite_template() -> Path:
    """A SQLite file at head, migrated once per process, removed when the process ends."""
    folder = Path(tempfile.mkdtemp(prefix="dptrain-sqlite-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "template.db"
    upgrade(f"sqlite:///{path}")
    # Everything in the file itself: a copy of it alone is then the whole database.
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


def migrated_sqlite(path: Path) -> str:
    """A SQLite database at head written to `path` (a copy of the template); its URL."""
    # The mode too: the service created the template 0600 (service/files.py), as it creates its own.
    shutil.copy(_sqlite_template(), path)
    return f"sqlite:///{path}"
