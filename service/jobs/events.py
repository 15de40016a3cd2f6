"""The server-sent-event stream of one job: state changes, new metric points, new checkpoints.

Each poll reads the job row first, then what was added since the last poll. The worker commits a
job's last metrics and checkpoints before its final transition, so once a poll sees a terminal job
it also sees everything that came before it: the final `job` event always follows them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import anyio
from sqlalchemy.orm import Session

from api_schemas import JobStatus
from service.jobs import metrics_repository, repository, service

KEEPALIVE_SECONDS = 15.0
# At most this many new points per poll; the rest (and the job event after them) come next poll.
MAX_POINTS_PER_POLL = 10_000

Event = tuple[str, Any]
# The last event of a stream whose token was revoked while it was open (the error body of a 401).
REVOKED = {"error": "Unauthorized", "detail": "the token of this stream was revoked"}


@dataclass
class StreamState:
    """What the stream has sent so far."""

    job_id: str
    since_step: int | None
    max_points: int | None
    updated_at: datetime | None = None
    metric_id: int | None = None
    checkpoint_id: int = 0
    done: bool = False


def poll(session: Session, state: StreamState) -> list[Event]:
    """The events that are due since the last poll, in the order they must be sent."""
    job = repository.get(session, job_id=state.job_id)
    if job is None:  # gone (never happens today): end without an end event
        state.done = True
        return []
    events: list[Event] = []
    first = state.metric_id is None
    if first:
        events.append(("job", service.present(session, jobs=[job])[0].model_dump(mode="json")))
        state.updated_at = job.updated_at
        top = metrics_repository.max_metric_id(session, job_id=state.job_id)
        series = metrics_repository.metric_series(
            session,
            job_id=state.job_id,
            since_step=state.since_step,
            names=None,
            max_points=state.max_points,
            up_to_id=top,
        )
        state.metric_id = top
        drained = True
    else:
        rows = metrics_repository.metrics_after(
            session, job_id=state.job_id, after_id=state.metric_id or 0, limit=MAX_POINTS_PER_POLL
        )
        series = {}
        for row_id, name, step, value in rows:
            series.setdefault(name, []).append((step, value))
            state.metric_id = row_id
        drained = len(rows) < MAX_POINTS_PER_POLL
    # The reporter never stores a non-finite point, but a row written by hand may hold one, and a
    # frame must stay JSON: such a point is left out rather than the stream cut.
    finite = {k: [[s, v] for s, v in points if math.isfinite(v)] for k, points in series.items()}
    if any(finite.values()):
        events.append(("metrics", {"series": {k: v for k, v in finite.items() if v}}))
    ckpts = repository.checkpoints_after(session, job_id=state.job_id, after_id=state.checkpoint_id)
    events += [("checkpoint", info.model_dump(mode="json")) for info in service.checkpoint_infos(ckpts)]
    if ckpts:
        state.checkpoint_id = ckpts[-1].id
    if not drained:
        return events  # the job's own news waits until every point before it is out
    if not first and job.updated_at != state.updated_at:
        events.append(("job", service.present(session, jobs=[job])[0].model_dump(mode="json")))
        state.updated_at = job.updated_at
    status = JobStatus(job.status)
    if status.is_terminal():
        events.append(("end", {"status": status.value}))
        state.done = True
    return events


def _frame(event_id: int, kind: str, data: Any) -> str:
    data_json = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return f"id: {event_id}\nevent: {kind}\ndata: {data_json}\n\n"


async def stream(
    *,
    sessions: Callable[[], Session],
    state: StreamState,
    poll_seconds: float,
    authorized: Callable[[], Awaitable[bool]],
) -> AsyncIterator[str]:
    """SSE frames until the job ends or `authorized()` turns False; each poll has its own session.

    `authorized` is asked before every poll but the first (the request was just authenticated):
    a stream outlives its request, so without it a revoked token would keep reading the job.
    """

    def _poll_once() -> list[Event]:
        with sessions() as session:
            return poll(session, state)

    event_id = 0
    last_sent = time.monotonic()
    while True:
        events = await anyio.to_thread.run_sync(_poll_once)
        for kind, data in events:
            event_id += 1
            yield _frame(event_id, kind, data)
            last_sent = time.monotonic()
        if state.done:
            return
        if time.monotonic() - last_sent >= KEEPALIVE_SECONDS:
            yield ": keep-alive\n\n"
            last_sent = time.monotonic()
        await anyio.sleep(poll_seconds)
        if not await authorized():
            # A last event rather than a bare close, so a client knows not to reconnect as it would
            # after a dropped connection.
            yield _frame(event_id + 1, "error", REVOKED)
            return
