"""The embedded service (SQLite): users, Idempotency-Key and the running-jobs limit work there too."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_schemas import JobStatus
from service.jobs import lifecycle
from service.scheduling.service import schedule_once
from tests.api_fixtures import (
    SPEC,
    RecordingDispatcher,
    as_user,
    register_node,
)


@pytest.fixture
def sqlite_settings() -> dict[str, Any]:
    return {"max_running_jobs_per_user": 1}


def test_users_idempotency_and_the_running_limit_on_sqlite(sqlite_client: TestClient) -> None:
    c = sqlite_client
    token = c.post("/v1/users", json={"name": "mona"}).json()["token"]
    assert c.post("/v1/users", json={"name": "mona"}).status_code == 409, "a taken name on SQLite"
    mona = as_user(token)
    first = c.post("/v1/jobs", json=SPEC, headers={**mona, "Idempotency-Key": "k"})
    again = c.post("/v1/jobs", json=SPEC, headers={**mona, "Idempotency-Key": "k"})
    assert (first.status_code, again.status_code) == (201, 200), (first.text, again.text)
    assert first.json()["id"] == again.json()["id"], "a replay answers the same job on SQLite"
    other = c.post("/v1/jobs", json={**SPEC, "name": "x"}, headers={**mona, "Idempotency-Key": "k"})
    assert other.status_code == 409, f"another spec under the key: expected 409, got {other.status_code}"

    second = c.post("/v1/jobs", json=SPEC, headers=mona).json()["id"]
    sessions = c.app.state.session_factory  # type: ignore[attr-defined]
    settings = c.app.state.settings  # type: ignore[attr-defined]
    register_node(sessions, name="solo", slots=4)
    sent = RecordingDispatcher()
    placed = schedule_once(sessions=sessions, dispatcher=sent, settings=settings)
    assert placed == [first.json()["id"]], f"limit 1 on SQLite: only the first runs, got {placed}"
    waiting = c.get(f"/v1/jobs/{second}", headers=mona).json()
    assert waiting["queued_reason"] == "waiting: its owner has 1 jobs running, the limit is 1", waiting
    c.delete("/v1/users/mona/tokens")
    assert c.get("/v1/users/me", headers=mona).status_code == 401, "revoked at once on SQLite"
    with sessions.begin() as s:
        lifecycle.transition(s, job_id=first.json()["id"], src=JobStatus.RUNNING, dst=JobStatus.FAILED)
    assert schedule_once(sessions=sessions, dispatcher=sent, settings=settings) == [second]
    assert sent.sent == [first.json()["id"], second], "each placed job's node got its start"
