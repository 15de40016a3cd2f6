"""The SQL behind readiness and the Prometheus scrape: each a single indexed query."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from service.models import Job, Metric, Worker


def ping(session: Session) -> None:
    """`SELECT 1`: raises if the database cannot be reached."""
    session.execute(text("SELECT 1"))


def job_counts(session: Session) -> dict[str, int]:
    """Jobs per status."""
    return {s: n for s, n in session.execute(select(Job.status, func.count()).group_by(Job.status))}


def start_delays(session: Session, *, started_after: datetime) -> Sequence[tuple[datetime, datetime]]:
    """(created_at, started_at) of the jobs started after `started_after`."""
    stmt = select(Job.created_at, Job.started_at).where(Job.started_at > started_after)
    return [(c, s) for c, s in session.execute(stmt) if s is not None]


def heartbeats(session: Session) -> Sequence[tuple[str, datetime]]:
    """(worker, last heartbeat) of every known worker."""
    return [(n, t) for n, t in session.execute(select(Worker.name, Worker.last_heartbeat))]


def last_metric_id(session: Session) -> int:
    """The newest metric point's id: it grows by one per point ingested, so its rate is the ingest rate."""
    return int(session.execute(select(func.max(Metric.id))).scalar() or 0)
