"""SQLAlchemy engine and session factory."""

from __future__ import annotations

import json
import time
import weakref
from functools import lru_cache
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings, get_settings
from service.files import create_private_sqlite
from service.webhooks.outbox import PUBLISHER
from service.webhooks.publisher import publisher_for

# A pooled connection handed back less than this long ago is used without a ping first.
PING_IF_IDLE_SECONDS = 1.0


def dump_json(value: Any) -> str:
    """JSON text of a column value; ValueError for NaN or infinity, which JSON has no words for."""
    # Python would write `NaN` and `Infinity`: PostgreSQL's JSONB refuses them, and SQLite stores them
    # in text its JSON functions call malformed, so one such row fails every query that extracts from it.
    return json.dumps(value, allow_nan=False)


def load_json(text: str | bytes) -> Any:
    """A column's JSON value; text that does not parse comes back as it is, a `str`, rather than raising."""
    # A row written by hand or by an older version must not make every query that loads it fail
    # (a job list, a placement round): whoever reads a spec or an error validates it anyway, and a
    # `str` where a dict belongs fails that validation.
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text if isinstance(text, str) else bytes(text).decode("utf-8", "replace")


def make_engine(database_url: str, *, pool_size: int = 16) -> Engine:
    """An engine tuned for the backend: WAL and a busy timeout on SQLite, a pool that pings on PostgreSQL.

    JSON columns are written by `dump_json` and read by `load_json` on both.
    """
    json_args: dict[str, Any] = {"json_serializer": dump_json, "json_deserializer": load_json}
    if database_url.startswith("sqlite"):
        create_private_sqlite(database_url)
        engine = create_engine(
            database_url, connect_args={"check_same_thread": False, "timeout": 30}, **json_args
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # API and worker write the same file: WAL lets readers go on while one writes.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    # Overflow connections are closed as soon as they are handed back, so a pool smaller than the
    # number of requests using it at once opens and closes a PostgreSQL backend (a fork) per request.
    engine = create_engine(database_url, pool_size=pool_size, max_overflow=pool_size, **json_args)
    _ping_if_idle(engine)
    return engine


def _ping_if_idle(engine: Engine) -> None:
    # Instead of pool_pre_ping's round trip at every checkout (a quarter of a cached poll's database
    # time): ping only a connection that sat in the pool for a while, the one that may have died
    # with a restarted server. One that was in use a moment ago is trusted; if the server went away
    # in that moment, the request fails once and SQLAlchemy, seeing the disconnect, replaces every
    # connection of the pool.
    @event.listens_for(engine, "checkin")
    def _returned(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info["returned_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        returned = record.info.get("returned_at")
        if returned is None or time.monotonic() - returned < PING_IF_IDLE_SECONDS:
            return  # fresh from connect(), or in use a moment ago
        try:
            alive = engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:  # noqa: BLE001 - any failure: dead
            raise DisconnectionError("pooled connection failed its ping") from exc
        if not alive:
            # The pool discards this connection and checks out another (a new one if need be).
            raise DisconnectionError("pooled connection failed its ping")


@lru_cache
def _engine_for(url: str, pool_size: int) -> Engine:
    return make_engine(url, pool_size=pool_size)


def get_engine(settings: Settings | None = None) -> Engine:
    """The process-wide engine for the configured database."""
    settings = settings or get_settings()
    return _engine_for(settings.database_url, settings.db_pool_size)


def session_factory(settings: Settings | None = None) -> sessionmaker[Session]:
    """A session factory bound to the configured database; its commits publish their webhook deliveries."""
    settings = settings or get_settings()
    info = {PUBLISHER: publisher_for(settings)}
    return sessionmaker(bind=get_engine(settings), expire_on_commit=False, info=info)


_READERS: weakref.WeakKeyDictionary[sessionmaker[Session], sessionmaker[Session]] = (
    weakref.WeakKeyDictionary()
)


def autocommit_reader(factory: sessionmaker[Session]) -> sessionmaker[Session]:
    """Sessions like `factory`'s whose statements each commit on their own (PostgreSQL engines only).

    For requests that only read, with one statement or with statements that need no common
    snapshot: PostgreSQL's READ COMMITTED gives each statement its own snapshot in a transaction
    too, so the answer is the same, without the BEGIN and COMMIT round trips. A factory bound to
    anything else (SQLite, or a test's connection inside its own transaction) is returned as it is.
    """
    reader = _READERS.get(factory)
    if reader is None:
        bind = factory.kw.get("bind")
        if isinstance(bind, Engine) and bind.dialect.name == "postgresql":
            autocommit = bind.execution_options(isolation_level="AUTOCOMMIT")
            reader = sessionmaker(bind=autocommit, expire_on_commit=False)
        else:
            reader = factory
        _READERS[factory] = reader
    return reader


def insert_for(session: Session, entity: Any) -> Any:
    """The dialect's INSERT (PostgreSQL's or SQLite's), so `on_conflict_do_nothing` works on both."""
    if session.get_bind().dialect.name == "postgresql":
        return pg_insert(entity)
    return sqlite_insert(entity)


def is_postgresql(session: Session) -> bool:
    """Whether `session` talks to PostgreSQL (some queries have a faster form there)."""
    return session.get_bind().dialect.name == "postgresql"
