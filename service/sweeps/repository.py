"""Sweep and trial rows."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from api_schemas import SweepState
from service.models import Job, Metric, Sweep, SweepTrial


def add(session: Session, *, sweep: Sweep) -> None:
    """Record a new sweep."""
    session.add(sweep)
    session.flush()


def get(session: Session, *, sweep_id: str, owner_id: int | None = None, lock: bool = False) -> Sweep | None:
    """A sweep (only the owner's when `owner_id` is given); `lock` holds its row to the commit."""
    stmt = select(Sweep).where(Sweep.id == sweep_id)
    if owner_id is not None:
        stmt = stmt.where(Sweep.owner_id == owner_id)
    if lock:
        stmt = stmt.with_for_update()
    return session.scalars(stmt).one_or_none()


def running_ids(session: Session) -> list[str]:
    """The ids of the sweeps still running."""
    return list(
        session.scalars(
            select(Sweep.id).where(Sweep.state == SweepState.RUNNING.value).order_by(Sweep.created_at)
        )
    )


def trials(session: Session, *, sweep_id: str) -> list[tuple[SweepTrial, Job | None]]:
    """A sweep's trials in number order, each with its job."""
    stmt = (
        select(SweepTrial, Job)
        .outerjoin(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id == sweep_id)
        .order_by(SweepTrial.number)
    )
    return [(t, j) for t, j in session.execute(stmt).all()]


def add_trial(session: Session, *, trial: SweepTrial) -> None:
    """Record a trial (its unique (sweep, number) stops a duplicate)."""
    session.add(trial)
    session.flush()


def series_of(session: Session, *, job_ids: Sequence[str], name: str) -> dict[str, list[tuple[int, float]]]:
    """Each job's values of one metric by step, the newest attempt's for a repeated step (one query;
    jobs without a value are left out)."""
    if not job_ids:
        return {}
    rows = session.execute(
        select(Metric.job_id, Metric.step, Metric.value)
        .where(Metric.job_id.in_(job_ids), Metric.name == name)
        .order_by(Metric.job_id, Metric.step, Metric.attempt)
    ).all()
    by_job: dict[str, dict[int, float]] = {}
    for job_id, step, value in rows:
        by_job.setdefault(job_id, {})[step] = value
    return {job_id: sorted(values.items()) for job_id, values in by_job.items()}


def encode_cursor(sweep: Sweep) -> str:
    """An opaque cursor after `sweep` (newest-first order)."""
    return base64.urlsafe_b64encode(f"{sweep.created_at.isoformat()}|{sweep.id}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The (created_at, id) a cursor points after; ValueError if it is not one of ours."""
    try:
        at, sweep_id = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        return datetime.fromisoformat(at), sweep_id
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError("not a cursor from GET /v1/sweeps") from exc


def page(
    session: Session, *, owner_id: int | None, limit: int, after: tuple[datetime, str] | None
) -> Sequence[Sweep]:
    """Up to `limit` sweeps newest first, after the cursor's."""
    stmt = select(Sweep).order_by(Sweep.created_at.desc(), Sweep.id.desc()).limit(limit)
    if owner_id is not None:
        stmt = stmt.where(Sweep.owner_id == owner_id)
    if after is not None:
        at, sweep_id = after
        stmt = stmt.where(or_(Sweep.created_at < at, and_(Sweep.created_at == at, Sweep.id < sweep_id)))
    return session.scalars(stmt).all()
