"""The API on either database: PostgreSQL (the conftest's rolled-back transaction) or a fresh SQLite file."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from service.app import create_app
from service.config import Settings
from service.db import is_postgresql
from tests.api_fixtures import ADMIN_TOKEN, RecordingScheduler
from tests.databases import migrated_sqlite

BACKENDS = ["postgresql", "sqlite"]


def sqlite_app_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """Settings of the embedded service (`dptrain up`): SQLite, migrated."""
    return Settings(
        database_url=migrated_sqlite(tmp_path / "dptrain.db"),
        broker_url="memory://",
        artifact_root=tmp_path / "artifacts",
        bootstrap_token=ADMIN_TOKEN,  # type: ignore[arg-type]
        **overrides,
    )


@contextmanager
def sqlite_app(tmp_path: Path, **overrides: Any) -> Iterator[TestClient]:
    """An admin's client of the real app on a fresh SQLite file."""
    app = create_app(sqlite_app_settings(tmp_path, **overrides), scheduler=RecordingScheduler())
    with TestClient(app, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
        yield c


def client_on(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    """For a fixture parametrized by BACKENDS: the conftest's PostgreSQL client, or a SQLite one."""
    if request.param == "postgresql":
        yield request.getfixturevalue("client")
        return
    with sqlite_app(tmp_path) as c:
        yield c


def sessions_of(client: TestClient) -> sessionmaker[Session]:
    """The session factory the client's app uses."""
    factory: sessionmaker[Session] = client.app.state.session_factory  # type: ignore[attr-defined]
    return factory


def store_raw(client: TestClient, *, job_id: str, column: str, raw: str) -> None:
    """Overwrite a JSON column of a job with `raw` text, as an older version or a hand would have."""
    with sessions_of(client).begin() as s:
        value = "CAST(:raw AS jsonb)" if is_postgresql(s) else ":raw"
        s.execute(text(f"UPDATE jobs SET {column} = {value} WHERE id = :id"), {"raw": raw, "id": job_id})
