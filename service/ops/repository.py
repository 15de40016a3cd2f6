"""The SQL behind readiness and the Prometheus scrape: each a single indexed query."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Beat:
    """A worker's last heartbeat, with what decides the name a non-admin may see."""

    name: str
    hostname: str
    address: str
    started_at: datetime
    last_heartbeat: datetime


def heartbeats(session: Session) -> Sequence[Beat]:
    """The last heartbeat of every known worker."""
    stmt = select(Worker.name, Worker.hostname, Worker.address, Worker.started_at, Worker.last_heartbeat)
    return [Beat(*row) for row in session.execute(stmt)]


def last_metric_id(session: Session) -> int:
    """The newest metric point's id: it grows by one per point ingested, so its rate is the ingest rate."""
    return int(session.execute(select(func.max(Metric.id))).scalar() or 0)
