"""The embedded service's database (SQLite): the polling features work there too, by slower paths."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.models import Metric
from tests.api_fixtures import SPEC, submit


@pytest.fixture
def sqlite_settings() -> dict[str, Any]:
    return {"sse_poll_seconds": 0.01}


def test_filters_downsampling_and_events_on_sqlite(sqlite_client: TestClient) -> None:
    c = sqlite_client
    a = submit(c, labels={"team": "vision", "tier": "gold"})
    b = submit(c, labels={"team": "vision"})
    ids = [
        j["id"]
        for j in c.get("/v1/jobs", params=[("label", "team=vision"), ("label", "tier=gold")]).json()["items"]
    ]
    assert ids == [a["id"]], f"label filter on SQLite: expected only {a['id']}, got {ids}"
    since = c.get(f"/v1/jobs/{a['id']}").json()["updated_at"]
    c.post(f"/v1/jobs/{b['id']}/cancel")
    ids = [j["id"] for j in c.get("/v1/jobs", params={"updated_since": since}).json()["items"]]
    assert ids == [b["id"]], f"updated_since on SQLite: expected only the cancelled job, got {ids}"

    sessions = c.app.state.session_factory  # type: ignore[attr-defined]
    with sessions.begin() as s:
        s.add_all(
            [Metric(job_id=a["id"], attempt=1, name="loss", step=i, value=float(i % 17)) for i in range(300)]
        )
    got = c.get(f"/v1/jobs/{a['id']}/metrics", params={"max_points": 20}).json()["series"]["loss"]
    values = [v for _, v in got]
    assert len(got) <= 20 and min(values) == 0.0 and max(values) == 16.0, f"downsampling on SQLite: {got}"

    c.post(f"/v1/jobs/{a['id']}/cancel")
    with c.stream("GET", f"/v1/jobs/{a['id']}/events") as r:
        kinds = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds == ["job", "metrics", "end"], f"events of a finished job on SQLite, got {kinds}"


def test_workers_and_job_times_are_aware_utc_on_sqlite(sqlite_client: TestClient) -> None:
    from workers.node.heartbeat import Heartbeat

    sessions = sqlite_client.app.state.session_factory  # type: ignore[attr-defined]
    Heartbeat(
        sessions=sessions, name="host-b:7", address="10.0.0.9", device="cpu", slots=1, interval=5.0
    ).beat()
    r = sqlite_client.get("/v1/workers")
    assert r.status_code == 200, f"expected the worker list on SQLite, got {r.status_code}: {r.text}"
    (w,) = r.json()["items"]
    aware = w["last_heartbeat"].endswith(("Z", "+00:00"))
    assert w["status"] == "alive" and aware, f"expected an alive worker with an aware UTC heartbeat: {w}"
    job = submit(sqlite_client)
    assert job["created_at"].endswith(("Z", "+00:00")), f"expected an aware UTC created_at, got {job}"


def test_sqlite_runs_without_the_job_cache(sqlite_client: TestClient) -> None:
    # No NOTIFY on SQLite, so nothing could drop a kept answer: every poll reads the database.
    job = sqlite_client.post("/v1/jobs", json=SPEC).json()
    assert sqlite_client.get(f"/v1/jobs/{job['id']}").status_code == 200
    cache = sqlite_client.app.state.poll_cache  # type: ignore[attr-defined]
    assert not cache.enabled and cache.get(job["id"]) is None
