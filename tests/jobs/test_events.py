"""The SSE stream of a job, read from a real uvicorn server while the test drives the job like a worker."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.app import create_app
from service.config import Settings
from service.db import session_factory
from service.jobs import lifecycle, repository
from service.models.base import utcnow
from service.users import repository as users
from tests.api_fixtures import ADMIN_TOKEN, SPEC, RecordingScheduler, as_user


@pytest.fixture
def live(
    own_database: str, tmp_path: Path, free_port: Callable[[], int]
) -> Iterator[tuple[httpx.Client, sessionmaker[Session]]]:
    """A uvicorn server (a thread) on a committed database: a stream polls from other threads."""
    settings = Settings(
        database_url=own_database,
        broker_url="memory://",
        artifact_root=tmp_path / "artifacts",
        bootstrap_token=ADMIN_TOKEN,  # type: ignore[arg-type]
        sse_poll_seconds=0.05,
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings, scheduler=RecordingScheduler()), port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=20,
        ) as client:
            for _ in range(200):
                try:
                    client.get("/healthz")
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
            yield client, session_factory(settings)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _events(response: httpx.Response) -> Iterator[tuple[int, str, Any]]:
    """(id, event, data) of each SSE frame; comments are skipped."""
    frame: dict[str, str] = {}
    for line in response.iter_lines():
        if line.startswith(":"):
            continue
        if not line:
            if frame:
                yield int(frame["id"]), frame["event"], json.loads(frame["data"])
            frame = {}
            continue
        key, _, value = line.partition(": ")
        frame[key] = value


def _drive_to_success(sessions: sessionmaker[Session], job_id: str) -> None:
    """What a worker writes for a short run: claim, metrics, a checkpoint, success."""
    with sessions.begin() as s:
        job = lifecycle.claim(s, job_id=job_id, worker="host:1")
        assert job is not None, "the job should be claimable"
        token = str(job.claim_token)
    with sessions.begin() as s:
        rows = [{"job_id": job_id, "attempt": 1, "name": "loss", "step": i, "value": 1.0 / i} for i in (1, 2)]
        repository.add_metrics(s, rows=rows)
        repository.upsert_checkpoint(
            s,
            row={
                "job_id": job_id,
                "attempt": 1,
                "step": 2,
                "path": "/x/ckpt-2.pt",
                "size_bytes": 3,
                "sha256": "a" * 64,
                "created_at": utcnow(),
            },
        )
        repository.fenced_update(s, job_id=job_id, claim_token=token, values={"step": 2})
    with sessions.begin() as s:
        lifecycle.transition(
            s, job_id=job_id, src=JobStatus.RUNNING, dst=JobStatus.SUCCEEDED, claim_token=token
        )


def test_events_come_in_order_and_the_stream_ends(live: tuple[httpx.Client, sessionmaker[Session]]) -> None:
    client, sessions = live
    assert client.get("/v1/jobs/nope/events").status_code == 404, "an unknown job is 404 before streaming"
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    seen: list[tuple[int, str, Any]] = []
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        assert r.status_code == 200, f"expected 200, got {r.status_code}"
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers["content-type"]
        for event in _events(r):
            seen.append(event)
            if len(seen) == 1:
                _drive_to_success(sessions, job_id)
    kinds = [kind for _, kind, _ in seen]
    assert seen[0][1] == "job" and seen[0][2]["status"] == "queued", f"first must be job(queued): {kinds}"
    ids = [event_id for event_id, _, _ in seen]
    assert ids == sorted(set(ids)), f"event ids must increase, got {ids}"
    assert kinds[-1] == "end" and seen[-1][2] == {"status": "succeeded"}, f"expected end last, got {seen[-1]}"
    final = max(i for i, (_, kind, data) in enumerate(seen) if kind == "job")
    assert seen[final][2]["status"] == "succeeded", f"the last job event is the final state: {seen[final]}"
    metrics = [i for i, (_, kind, _) in enumerate(seen) if kind == "metrics"]
    checkpoints = [i for i, (_, kind, _) in enumerate(seen) if kind == "checkpoint"]
    assert metrics and max(metrics) < final, f"metrics must come before the final job event: {kinds}"
    assert checkpoints and max(checkpoints) < final, f"the checkpoint must come before it too: {kinds}"
    points = [p for i in metrics for p in seen[i][2]["series"]["loss"]]
    assert points == [[1, 1.0], [2, 0.5]], f"each point once, in order, got {points}"
    assert seen[checkpoints[0]][2]["step"] == 2


def test_first_metrics_event_honours_since_step(live: tuple[httpx.Client, sessionmaker[Session]]) -> None:
    client, sessions = live
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    with sessions.begin() as s:
        rows = [
            {"job_id": job_id, "attempt": 1, "name": "loss", "step": i, "value": float(i)} for i in range(10)
        ]
        repository.add_metrics(s, rows=rows)
    client.post(f"/v1/jobs/{job_id}/cancel")
    with client.stream("GET", f"/v1/jobs/{job_id}/events", params={"since_step": 6}) as r:
        seen = list(_events(r))
    kinds = [kind for _, kind, _ in seen]
    assert kinds == ["job", "metrics", "end"], f"a finished job: job, metrics, end; got {kinds}"
    assert seen[1][2]["series"]["loss"] == [[7, 7.0], [8, 8.0], [9, 9.0]], seen[1][2]


def test_a_stream_ends_with_an_error_event_once_its_token_is_revoked(
    live: tuple[httpx.Client, sessionmaker[Session]],
) -> None:
    client, sessions = live
    token = client.post("/v1/users", json={"name": "rita"}).json()["token"]
    job_id = client.post("/v1/jobs", json=SPEC, headers=as_user(token)).json()["id"]
    seen: list[tuple[str, Any]] = []
    revoked_at = 0.0
    # The job stays queued, so only the revocation can end this stream; a read timeout fails it
    # rather than let it hang on keep-alives.
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=as_user(token), timeout=5) as r:
        assert r.status_code == 200, f"expected 200, got {r.status_code}"
        for _, kind, data in _events(r):
            seen.append((kind, data))
            if len(seen) == 1:
                # Straight in the database, as the CLI or another API process would: this server
                # hears nothing and learns it when its cached entry of the token expires.
                with sessions.begin() as s:
                    user = users.by_name(s, name="rita")
                    assert user is not None
                    users.revoke_tokens(s, user_id=user.id, now=utcnow())
                revoked_at = time.monotonic()
    took = time.monotonic() - revoked_at
    assert [kind for kind, _ in seen] == ["job", "error"], f"expected job, then error: {seen}"
    assert seen[-1][1] == {"error": "Unauthorized", "detail": "the token of this stream was revoked"}, seen
    # The cache's bound (DPTRAIN_AUTH_CACHE_SECONDS, 1 s) and a poll (0.05 s), with room for a slow host.
    assert took < 1.0 + 0.05 + 1.5, (
        f"the stream must end within the cache window and a poll, took {took:.2f} s"
    )
