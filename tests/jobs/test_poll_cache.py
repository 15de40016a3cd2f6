"""The job cache behind `GET /v1/jobs/{id}`: polls without a query, and never a stale answer kept.

Its rules on their own (`JobPollCache`), then the real app on a database whose changes commit, so
that migration 0006's trigger notifies them as it does in production.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from service.app import create_app
from service.config import Settings
from service.db import session_factory
from service.jobs import lifecycle, repository, service
from service.jobs.poll_cache import APPLICATION_NAME, JobPollCache
from tests.api_fixtures import ADMIN_TOKEN, SPEC, RecordingScheduler, add_user, as_user

# ---- the rules --------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _put(cache: JobPollCache, job_id: str, seen: int, body: bytes = b"{}") -> None:
    cache.put(job_id, owner_id=1, etag='"e"', body=body, seen_seq=seen)


def test_nothing_is_kept_until_the_listener_is_up() -> None:
    cache = JobPollCache()
    _put(cache, "a", cache.seq)
    assert cache.get("a") is None
    cache.enable()
    _put(cache, "a", cache.seq)
    assert cache.get("a") is not None


def test_an_answer_read_before_any_notification_is_not_kept() -> None:
    cache = JobPollCache()
    cache.enable()
    seen = cache.seq  # a poll starts its query ...
    cache.invalidate("other-job")  # ... a change (of any job) is notified meanwhile ...
    _put(cache, "a", seen)  # ... so what it read may be older than that change
    assert cache.get("a") is None


def test_a_notification_drops_the_job_and_only_that_job() -> None:
    cache = JobPollCache()
    cache.enable()
    _put(cache, "a", cache.seq)
    _put(cache, "b", cache.seq)
    cache.invalidate("a")
    assert cache.get("a") is None and cache.get("b") is not None


def test_losing_the_listener_empties_the_cache_and_a_reconnect_starts_empty() -> None:
    cache = JobPollCache()
    cache.enable()
    _put(cache, "a", cache.seq)
    seen = cache.seq
    cache.disable()
    assert not cache.enabled and cache.get("a") is None
    _put(cache, "b", cache.seq)
    assert cache.get("b") is None, "nothing is kept while no notification can arrive"
    cache.enable()
    _put(cache, "c", seen)  # read before the outage: notifications of the outage are lost
    assert cache.get("c") is None


def test_entries_expire_and_the_size_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    cache = JobPollCache(max_age=5.0, clock=clock)
    cache.enable()
    _put(cache, "a", cache.seq)
    clock.now += 5.0
    assert cache.get("a") is None
    monkeypatch.setattr(JobPollCache, "MAX_ENTRIES", 3)
    for job in "bcde":
        _put(cache, job, cache.seq)
    assert len(cache._entries) <= 3 and cache.get("e") is not None


# ---- the real app on a committed database ---------------------------------------------------------


@pytest.fixture(scope="module")
def settings(own_database: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    # Committed changes, so PostgreSQL notifies them to the cache's LISTEN connection.
    return Settings(
        database_url=own_database,
        broker_url="memory://",
        artifact_root=tmp_path_factory.mktemp("pollcache") / "artifacts",
        bootstrap_token=ADMIN_TOKEN,  # type: ignore[arg-type]
        poll_cache=True,
    )


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings, scheduler=RecordingScheduler())
    with TestClient(app, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
        _until(lambda: app.state.poll_cache.enabled, "the cache's LISTEN connection never came up")
        yield c


def _until(cond: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(what)


def _cache(client: TestClient) -> JobPollCache:
    cache: JobPollCache = client.app.state.poll_cache  # type: ignore[attr-defined]
    return cache


def _no_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a cached poll went to the database")

    monkeypatch.setattr(service, "get_visible_with_owner", refuse)
    monkeypatch.setattr(service, "to_schema", refuse)


def test_a_repeated_poll_is_answered_without_the_database(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = client.post("/v1/jobs", json=SPEC).json()
    first = client.get(f"/v1/jobs/{job['id']}")
    assert first.status_code == 200 and _cache(client).get(job["id"]) is not None
    _no_queries(monkeypatch)
    again = client.get(f"/v1/jobs/{job['id']}")
    assert (again.status_code, again.content, again.headers["etag"]) == (
        200,
        first.content,
        first.headers["etag"],
    )
    r = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": first.headers["etag"]})
    assert (r.status_code, r.content) == (304, b"")


def test_a_change_committed_elsewhere_reaches_the_next_polls(client: TestClient, settings: Settings) -> None:
    # As a worker's reporter does it: its own connection, its own commit.
    job = client.post("/v1/jobs", json=SPEC).json()
    etag = client.get(f"/v1/jobs/{job['id']}").headers["etag"]
    with session_factory(settings).begin() as s:
        claimed = lifecycle.claim(s, job_id=job["id"], worker="host:1")
        assert claimed is not None
        repository.fenced_update(
            s, job_id=job["id"], claim_token=str(claimed.claim_token), values={"step": 3}
        )
    # The notification is delivered after the commit, asynchronously: milliseconds, not a TTL.
    start = time.monotonic()
    r = _until(
        lambda: (
            (x := client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": etag})).status_code == 200
            and x
        ),
        "a committed change never ended the cached 304s",
        timeout=5.0,
    )
    assert time.monotonic() - start < 5.0
    assert (r.json()["status"], r.json()["progress"]["step"]) == ("running", 3), r.json()
    assert r.headers["etag"] != etag


def test_a_cancel_through_this_process_shows_at_the_very_next_poll(client: TestClient) -> None:
    job = client.post("/v1/jobs", json=SPEC).json()
    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"
    assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"


def test_a_cached_job_stays_invisible_to_other_users(client: TestClient, settings: Settings) -> None:
    job = client.post("/v1/jobs", json=SPEC).json()
    assert client.get(f"/v1/jobs/{job['id']}").status_code == 200
    with session_factory(settings)() as s:
        token = add_user(s, f"mallory-{time.monotonic_ns()}")
    r = client.get(f"/v1/jobs/{job['id']}", headers=as_user(token))
    assert r.status_code == 404, f"another user's cached job must stay hidden, got {r.status_code}"


def test_without_its_listener_the_cache_steps_aside_until_it_is_back(
    client: TestClient, settings: Settings
) -> None:
    job = client.post("/v1/jobs", json=SPEC).json()
    assert client.get(f"/v1/jobs/{job['id']}").status_code == 200
    cache = _cache(client)
    with session_factory(settings).begin() as s:
        s.execute(
            text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :name"),
            {"name": APPLICATION_NAME},
        )
    _until(lambda: not cache.enabled, "a lost LISTEN connection must turn the cache off")
    assert cache.get(job["id"]) is None
    with session_factory(settings).begin() as s:
        lifecycle.claim(s, job_id=job["id"], worker="host:1")
    # While it is off, polls read the database: the change shows at once.
    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "running"
    _until(lambda: cache.enabled, "the listener must reconnect", timeout=15.0)
    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "running"
    assert cache.get(job["id"]) is not None, "back on, the cache keeps answers again"


def test_the_trigger_notifies_deletes_too(client: TestClient, settings: Settings) -> None:
    job = client.post("/v1/jobs", json=SPEC).json()
    assert client.get(f"/v1/jobs/{job['id']}").status_code == 200
    with session_factory(settings).begin() as s:
        s.execute(text("DELETE FROM jobs WHERE id = :id"), {"id": job["id"]})
    _until(lambda: client.get(f"/v1/jobs/{job['id']}").status_code == 404, "a deleted job is still served")
