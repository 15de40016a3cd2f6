"""SQLAlchemy engine and session factory."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings, get_settings


def make_engine(database_url: str) -> Engine:
    """An engine tuned for the backend: WAL and a busy timeout on SQLite, pre-ping on PostgreSQL."""
    if database_url.startswith("sqlite"):
        engine = create_engine(database_url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # API and worker write the same file: WAL lets readers go on while one writes.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(database_url, pool_pre_ping=True, pool_size=10, max_overflow=20)


@lru_cache
def _engine_for(url: str) -> Engine:
    return make_engine(url)


def get_engine(settings: Settings | None = None) -> Engine:
    """The process-wide engine for the configured database."""
    return _engine_for((settings or get_settings()).database_url)


def session_factory(settings: Settings | None = None) -> sessionmaker[Session]:
    """A session factory bound to the configured database."""
    return sessionmaker(bind=get_engine(settings), expire_on_commit=False)


def insert_for(session: Session, entity: Any) -> Any:
    """The dialect's INSERT (PostgreSQL's or SQLite's), so `on_conflict_do_nothing` works on both."""
    if session.get_bind().dialect.name == "postgresql":
        return pg_insert(entity)
    return sqlite_insert(entity)


def is_postgresql(session: Session) -> bool:
    """Whether `session` talks to PostgreSQL (some queries have a faster form there)."""
    return session.get_bind().dialect.name == "postgresql"
