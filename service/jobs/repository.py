"""Every SQL query of the jobs domain."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, insert, or_, select, update
from sqlalchemy.orm import Session

from service.models import Checkpoint, Job, JobTransition, LogLine, Metric, User
from service.models.base import utcnow


def encode_cursor(job: Job) -> str:
    """An opaque keyset cursor: the (created_at, id) of the last row of a page."""
    raw = json.dumps([job.created_at.isoformat(), job.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """Inverse of encode_cursor; ValueError on anything malformed."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, job_id = json.loads(raw)
        return datetime.fromisoformat(created), str(job_id)
    except Exception as exc:  # noqa: BLE001 - any decoding problem is the client's bad cursor
        raise ValueError("malformed cursor") from exc


def get(session: Session, *, job_id: str, owner_id: int | None = None) -> Job | None:
    """A job by id, optionally only if it belongs to `owner_id`."""
    stmt = select(Job).where(Job.id == job_id)
    if owner_id is not None:
        stmt = stmt.where(Job.owner_id == owner_id)
    return session.execute(stmt).scalar_one_or_none()


def owner_names(session: Session, *, owner_ids: set[int]) -> dict[int, str]:
    """User names by id."""
    if not owner_ids:
        return {}
    rows = session.execute(select(User.id, User.name).where(User.id.in_(owner_ids)))
    return {uid: name for uid, name in rows}


def list_page(
    session: Session,
    *,
    owner_id: int | None,
    limit: int,
    after: tuple[datetime, str] | None,
    status: str | None,
) -> Sequence[Job]:
    """One page of jobs, newest first, by keyset on (created_at, id)."""
    stmt = select(Job)
    if owner_id is not None:
        stmt = stmt.where(Job.owner_id == owner_id)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if after is not None:
        created, job_id = after
        stmt = stmt.where(or_(Job.created_at < created, and_(Job.created_at == created, Job.id < job_id)))
    stmt = stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    return list(session.execute(stmt).scalars().all())


def request_cancel(session: Session, *, job_id: str) -> None:
    """Flag a running job for its worker to stop (a request, not a state change)."""
    session.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))


def metric_series(
    session: Session, *, job_id: str, since_step: int | None, names: list[str] | None
) -> dict[str, list[tuple[int, float]]]:
    """Metric points per name in step order (the last value wins if an attempt re-reported a step)."""
    stmt = select(Metric.name, Metric.step, Metric.value).where(Metric.job_id == job_id)
    if since_step is not None:
        stmt = stmt.where(Metric.step > since_step)
    if names:
        stmt = stmt.where(Metric.name.in_(names))
    stmt = stmt.order_by(Metric.name, Metric.step, Metric.id)
    series: dict[str, dict[int, float]] = {}
    for name, step, value in session.execute(stmt):
        series.setdefault(name, {})[step] = value
    return {name: sorted(points.items()) for name, points in series.items()}


def checkpoints(session: Session, *, job_id: str) -> Sequence[Checkpoint]:
    """A job's checkpoints, oldest first."""
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)
    return session.execute(stmt).scalars().all()


def checkpoint(session: Session, *, job_id: str, checkpoint_id: int) -> Checkpoint | None:
    """One checkpoint of a job."""
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.id == checkpoint_id)
    return session.execute(stmt).scalar_one_or_none()


def log_lines(
    session: Session, *, job_id: str, after: int | None, rank: int | None, limit: int
) -> Sequence[LogLine]:
    """Log lines after the cursor id, in order."""
    stmt = select(LogLine).where(LogLine.job_id == job_id)
    if after is not None:
        stmt = stmt.where(LogLine.id > after)
    if rank is not None:
        stmt = stmt.where(LogLine.rank == rank)
    return session.execute(stmt.order_by(LogLine.id).limit(limit)).scalars().all()


def transitions(session: Session, *, job_id: str) -> Sequence[JobTransition]:
    """The state timeline of a job."""
    stmt = select(JobTransition).where(JobTransition.job_id == job_id).order_by(JobTransition.id)
    return session.execute(stmt).scalars().all()


# --- writes by the worker, each fenced by the attempt's claim token ---------------------------


def fenced_update(session: Session, *, job_id: str, claim_token: str, values: dict[str, Any]) -> bool:
    """Update a running job's progress fields only if `claim_token` still owns it (no values: just check)."""
    if not values:
        owner = select(Job.id).where(Job.id == job_id, Job.claim_token == claim_token)
        return session.execute(owner).first() is not None
    stmt = update(Job).where(Job.id == job_id, Job.claim_token == claim_token).values(**values)
    return (session.execute(stmt).rowcount or 0) > 0  # type: ignore[attr-defined]


def cancel_requested(session: Session, *, job_id: str) -> bool:
    """Whether someone asked this job to stop."""
    return bool(session.execute(select(Job.cancel_requested).where(Job.id == job_id)).scalar_one())


def add_metrics(session: Session, *, rows: list[dict[str, Any]]) -> None:
    """Insert metric points in one statement."""
    if rows:
        session.execute(insert(Metric), rows)


def add_log_lines(session: Session, *, rows: list[dict[str, Any]]) -> None:
    """Insert log lines in one statement."""
    if rows:
        session.execute(insert(LogLine), rows)


def upsert_checkpoint(session: Session, *, row: dict[str, Any]) -> None:
    """Record a checkpoint; a later attempt that rewrites the same step replaces the row."""
    session.execute(
        delete(Checkpoint).where(Checkpoint.job_id == row["job_id"], Checkpoint.step == row["step"])
    )
    session.execute(insert(Checkpoint), [row])


def delete_checkpoints(session: Session, *, job_id: str, paths: list[str]) -> None:
    """Forget checkpoints whose files the engine removed (keep_last)."""
    if paths:
        session.execute(delete(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.path.in_(paths)))


def stale_queued(session: Session, *, older_than: datetime, limit: int) -> list[tuple[str, str]]:
    """Take queued jobs untouched since `older_than`: bump their `updated_at` and return (id, device).

    The conditional UPDATE hands each stale job to one reconciler per period even with many workers.
    """
    stmt = (
        update(Job)
        .where(
            Job.id.in_(
                select(Job.id)
                .where(Job.status == "queued", Job.updated_at < older_than)
                .order_by(Job.created_at)
                .limit(limit)
                .scalar_subquery()
            ),
            Job.status == "queued",
            Job.updated_at < older_than,
        )
        .values(updated_at=utcnow())
        .returning(Job.id, Job.spec)
    )
    return [(job_id, str(spec["resources"]["device"])) for job_id, spec in session.execute(stmt)]
