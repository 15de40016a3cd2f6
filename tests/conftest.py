"""Shared fixtures: a real PostgreSQL database built by `alembic upgrade head`, rolled back per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.api_fixtures"]
PG_ADMIN_URL = os.environ.get("DPTRAIN_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("DPTRAIN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def create_database(prefix: str = "dptrain_test") -> str:
    """A fresh, migrated PostgreSQL database; fails the test (never skips) if PostgreSQL is down."""
    from migrations import upgrade

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"PostgreSQL is required at {PG_ADMIN_URL} and could not be reached: {exc}")
    finally:
        admin.dispose()
    url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    return url


def drop_database(url: str) -> None:
    """Drop a database made by create_database, disconnecting whoever is left."""
    name = make_url(url).database
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """One migrated database for the whole run (tests roll back their own changes)."""
    url = create_database()
    yield url
    drop_database(url)


@pytest.fixture
def connection(pg_url: str) -> Iterator[Connection]:
    """A connection inside a transaction that is rolled back after the test (polar's pattern)."""
    engine = create_engine(pg_url)
    conn = engine.connect()
    trans = conn.begin()
    yield conn
    trans.rollback()
    conn.close()
    engine.dispose()


@pytest.fixture
def sessions(connection: Connection) -> sessionmaker[Session]:
    """Sessions whose commits only release a savepoint of the test's transaction."""
    return sessionmaker(bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False)


@pytest.fixture
def db(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """A session for arranging and checking rows."""
    with sessions() as session:
        yield session
