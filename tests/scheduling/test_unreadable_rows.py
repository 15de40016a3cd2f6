"""Placement survives a queued job it cannot read: that job ends `failed` with the reason, the others start.

The bad rows are written with raw SQL, as an older version stored them (Python's json wrote `NaN` and
`Infinity`, which SQLite's JSON functions call malformed) or as a hand could have.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.scheduling import repository
from service.scheduling.service import queued_heads, schedule_once
from tests.api_fixtures import RecordingDispatcher, register_node, submit
from tests.backends import BACKENDS, client_on, sessions_of, store_raw


@pytest.fixture(params=BACKENDS)
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    yield from client_on(request, tmp_path)


def _with(stored: dict[str, Any], **over: Any) -> str:
    # allow_nan: the way a version before strict input wrote a spec with an infinite number.
    return json.dumps({**stored, **over}, allow_nan=True)


# (what is wrong, the stored text given the job's valid stored spec, the start of the reason)
BOTH = [
    (
        "resources of the wrong type",
        lambda s: _with(s, resources={"nodes": "two", "processes_per_node": 1}),
        "the stored spec's resources do not validate: nodes: Input should be a valid integer",
    ),
    (
        "resources out of range",
        lambda s: _with(s, resources={"nodes": 10**30}),
        "the stored spec's resources do not validate: nodes:",
    ),
    ("resources not an object", lambda s: _with(s, resources="cpu"), "the stored spec's resources do not"),
    ("a spec that is an array", lambda s: json.dumps([s]), "the stored spec is not a JSON object: array"),
]
# PostgreSQL's JSONB never holds these: only SQLite (the embedded `dptrain up`) stored them.
SQLITE_ONLY = [
    (
        "Infinity written by an older version",
        lambda s: _with(s, hyperparameters={**s["hyperparameters"], "lr": float("inf")}),
        "the stored spec is not a JSON object: invalid JSON",
    ),
    ("text cut short", lambda s: json.dumps(s)[:40], "the stored spec is not a JSON object: invalid JSON"),
]
CASES = [pytest.param(b, *c, id=f"{b}-{c[0]}") for b in BACKENDS for c in BOTH] + [
    pytest.param("sqlite", *c, id=f"sqlite-{c[0]}") for c in SQLITE_ONLY
]


@pytest.mark.parametrize(("api", "what", "bad_text", "reason"), CASES, indirect=["api"])
def test_the_unreadable_job_fails_with_its_reason_and_the_round_places_the_others(
    api: TestClient, what: str, bad_text: Any, reason: str
) -> None:
    sessions, settings = sessions_of(api), api.app.state.settings  # type: ignore[attr-defined]
    register_node(sessions, name="solo", slots=4)
    # First in placement order, so a round that stopped at it would place nothing.
    bad = submit(api, name="bad", priority=10)
    good = submit(api, name="good")
    store_raw(api, job_id=bad["id"], column="spec", raw=bad_text(bad["spec"]))

    placed = schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=settings)

    assert placed == [good["id"]], f"{what}: the good job is placed anyway, got {placed}"
    shown = api.get(f"/v1/jobs/{bad['id']}")
    assert shown.status_code == 200, f"the culprit is shown, not a {shown.status_code}: {shown.text}"
    job = shown.json()
    assert job["status"] == "failed", f"{what}: expected failed, got {job['status']}"
    assert job["error"]["type"] == "InvalidSpec", job["error"]
    assert job["error"]["message"].startswith(reason), f"expected {reason!r}, got {job['error']['message']!r}"
    last = api.get(f"/v1/jobs/{bad['id']}/timeline").json()["items"][-1]
    assert (last["from_status"], last["to_status"], last["reason"]) == (
        "queued",
        "failed",
        job["error"]["message"],
    ), f"the timeline says why: {last}"
    listed = api.get("/v1/jobs")
    assert listed.status_code == 200, f"the job list with the culprit in it: {listed.status_code}"
    assert {j["id"] for j in listed.json()["items"]} == {bad["id"], good["id"]}
    # The next round has nothing left to say about it.
    assert schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=settings) == []


def test_a_readable_spec_asks_for_its_resources(api: TestClient) -> None:
    register_node(sessions_of(api), name="roomy", slots=4)  # else it is unplaceable: no round reads it
    job = submit(api, resources={"nodes": 1, "processes_per_node": 4, "device": "cpu"})
    with sessions_of(api)() as s:
        queued, unreadable = queued_heads(s, running={}, settings=api.app.state.settings)  # type: ignore[attr-defined]
    assert unreadable == [], unreadable
    assert [(q.job_id, q.needs) for q in queued] == [
        (job["id"], repository.QueuedNeeds(device="cpu", nodes=1, processes_per_node=4))
    ]


def test_a_spec_without_resources_asks_for_the_defaults(api: TestClient) -> None:
    register_node(sessions_of(api), name="roomy", slots=4)
    job = submit(api)
    store_raw(api, job_id=job["id"], column="spec", raw=json.dumps({"name": "bare", "recipe": "mlp"}))
    with sessions_of(api)() as s:
        queued, unreadable = queued_heads(s, running={}, settings=api.app.state.settings)  # type: ignore[attr-defined]
    assert (unreadable, [q.needs for q in queued]) == ([], [repository.QueuedNeeds("cpu", 1, 1)])
