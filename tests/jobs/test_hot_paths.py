"""The poll and submit paths as production runs them: a committed database, a real pool."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text

from service import db
from service.app import create_app
from service.config import Settings
from service.db import session_factory
from service.jobs import lifecycle, repository, service
from tests.api_fixtures import ADMIN_TOKEN, SPEC, RecordingScheduler

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def settings(own_database: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """A database of its own, where every request commits (and reads autocommit), as in production."""
    tmp = tmp_path_factory.mktemp("hot")
    return Settings(
        database_url=own_database,
        broker_url="memory://",
        artifact_root=tmp / "artifacts",
        bootstrap_token=ADMIN_TOKEN,  # type: ignore[arg-type]
        db_pool_size=2,
        # The database path of every poll; tests/jobs/test_poll_cache.py covers the job cache.
        poll_cache=False,
    )


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, scheduler=RecordingScheduler()), headers=AUTH) as c:
        yield c


def test_polls_see_every_committed_change_and_304_until_then(client: TestClient, settings: Settings) -> None:
    job = client.post("/v1/jobs", json=SPEC).json()
    r = client.get(f"/v1/jobs/{job['id']}")
    etag = r.headers["etag"]
    assert r.status_code == 200 and r.json() == job, "a poll answers what the submit answered"
    assert client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": etag}).status_code == 304
    with session_factory(settings).begin() as s:
        claimed = lifecycle.claim(s, job_id=job["id"], worker="host:1")
        assert claimed is not None
        repository.fenced_update(
            s, job_id=job["id"], claim_token=str(claimed.claim_token), values={"step": 3}
        )
    r = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": etag})
    assert r.status_code == 200, f"a committed change must end the 304s, got {r.status_code}"
    assert (r.json()["status"], r.json()["progress"]["step"]) == ("running", 3), r.json()
    assert r.headers["etag"] != etag


def test_a_304_never_builds_the_body(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    job = client.post("/v1/jobs", json=SPEC).json()
    etag = client.get(f"/v1/jobs/{job['id']}").headers["etag"]

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("the body was built for a 304")

    monkeypatch.setattr(service, "to_schema", refuse)
    r = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": etag})
    assert (r.status_code, r.content) == (304, b""), f"expected an empty 304, got {r.status_code}"


def test_an_idle_connection_killed_by_the_server_is_replaced_not_failed(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = client.post("/v1/jobs", json=SPEC).json()
    assert client.get(f"/v1/jobs/{job['id']}").status_code == 200
    # A server restart, as the pool sees it: every connection it holds is gone.
    name = settings.database_url.rsplit("/", 1)[1]
    with session_factory(Settings(database_url=settings.database_url)).begin() as s:
        s.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :db AND pid <> pg_backend_pid()"
            ),
            {"db": name},
        )
    monkeypatch.setattr(db, "PING_IF_IDLE_SECONDS", 0.0)  # as if they had sat idle for a while
    for _ in range(3):
        r = client.get(f"/v1/jobs/{job['id']}")
        assert r.status_code == 200, f"a dead pooled connection must be pinged and replaced: {r.text}"


def test_more_concurrent_requests_than_connections_do_not_deadlock(settings: Settings) -> None:
    # Two pooled connections (four with the overflow) and two threadpool threads for 24 requests at
    # once. A sync route holds its connection from its route hop to its commit hop: if commits
    # queued for the threads behind route hops that wait for a connection, nothing would move
    # until the pool's 30 s timeout. The polls' and submits' single hops hold no connection while
    # they wait for a thread.
    app = create_app(settings, scheduler=RecordingScheduler())

    async def burst(app: FastAPI) -> list[int]:
        async with app.router.lifespan_context(app):
            anyio.to_thread.current_default_thread_limiter().total_tokens = 2
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as c:
                job = (await c.post("/v1/jobs", json=SPEC)).json()
                calls = [c.get("/v1/jobs") for _ in range(16)]
                calls += [c.get(f"/v1/jobs/{job['id']}") for _ in range(4)]
                calls += [c.post("/v1/jobs", json=SPEC) for _ in range(4)]
                return [r.status_code for r in await asyncio.gather(*calls)]

    started = time.monotonic()
    codes = asyncio.run(burst(app))
    assert codes == [200] * 20 + [201] * 4, f"every request answered, got {codes}"
    assert time.monotonic() - started < 20, "the burst must not wait for the pool's timeout"


def test_settings_for_the_pool_reach_the_engine(settings: Settings, tmp_path: Path) -> None:
    engine = db.get_engine(settings)
    assert engine.pool.size() == 2, "DPTRAIN_DB_POOL_SIZE sizes the connection pool"  # type: ignore[attr-defined]
