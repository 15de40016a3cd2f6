"""Every SQL query of the jobs domain."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Float,
    Row,
    and_,
    cast,
    delete,
    func,
    insert,
    or_,
    select,
    type_coerce,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB, distinct_on
from sqlalchemy.dialects.postgresql import array as pg_array
from sqlalchemy.orm import Session

from service.db import insert_for
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


def insert_job(session: Session, *, values: dict[str, Any]) -> Job | None:
    """Insert a job row; None if its (owner_id, idempotency_key) is taken (the unique constraint decides).

    On PostgreSQL a conflicting insert waits for the other transaction to commit or roll back, so
    None means the winner is committed and readable by the next statement.
    """
    stmt = (
        insert_for(session, Job)
        .values(**values)
        .on_conflict_do_nothing(index_elements=[Job.owner_id, Job.idempotency_key])
        .returning(Job.id)
    )
    job_id = session.execute(stmt).scalar_one_or_none()
    return None if job_id is None else session.get(Job, job_id)


def by_idempotency_key(session: Session, *, owner_id: int, key: str) -> Job | None:
    """The job an owner submitted under `key`."""
    stmt = select(Job).where(Job.owner_id == owner_id, Job.idempotency_key == key)
    return session.execute(stmt).scalar_one_or_none()


def owner_names(session: Session, *, owner_ids: set[int]) -> dict[int, str]:
    """User names by id."""
    if not owner_ids:
        return {}
    rows = session.execute(select(User.id, User.name).where(User.id.in_(owner_ids)))
    return {uid: name for uid, name in rows}


def _is_postgresql(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def list_page(
    session: Session,
    *,
    owner_id: int | None,
    limit: int,
    after: tuple[datetime, str] | None,
    status: str | None,
    labels: dict[str, str] | None = None,
    updated_since: datetime | None = None,
) -> Sequence[Job]:
    """One page of jobs, newest first, by keyset on (created_at, id)."""
    stmt = select(Job)
    if owner_id is not None:
        stmt = stmt.where(Job.owner_id == owner_id)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if updated_since is not None:
        stmt = stmt.where(Job.updated_at > updated_since)
    if labels:
        if _is_postgresql(session):
            # `@>` is what the GIN (jsonb_path_ops) index of migration 0002 serves.
            stmt = stmt.where(type_coerce(Job.labels, JSONB).contains(labels))
        else:
            stmt = stmt.where(*(Job.labels[k].as_string() == v for k, v in labels.items()))
    if after is not None:
        created, job_id = after
        stmt = stmt.where(or_(Job.created_at < created, and_(Job.created_at == created, Job.id < job_id)))
    stmt = stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    return list(session.execute(stmt).scalars().all())


def request_cancel(session: Session, *, job_id: str) -> None:
    """Flag a running job for its worker to stop (a request, not a state change)."""
    session.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))


def metric_series(
    session: Session,
    *,
    job_id: str,
    since_step: int | None,
    names: list[str] | None,
    max_points: int | None = None,
    up_to_id: int | None = None,
) -> dict[str, list[tuple[int, float]]]:
    """Metric points per name in step order, each series downsampled to `max_points` if given.

    The last value wins if an attempt re-reported a step; `up_to_id` leaves out later points.
    """
    # Querying by explicit names lets the (job_id, name, step, id) index jump straight to each
    # series' `since_step`, where "job_id = ? AND step > ?" would walk every point of the job.
    names = names or series_names(session, job_id=job_id)
    if not names:
        return {}
    if max_points is None:
        return _raw_series(session, job_id=job_id, since_step=since_step, names=names, up_to_id=up_to_id)
    where = _metric_filter(job_id=job_id, since_step=since_step, up_to_id=up_to_id)
    extents = {
        name: _extent(session, where=[*where, Metric.name == name], cap=max_points + 1) for name in names
    }
    small = [name for name, (n, _, _) in extents.items() if 0 < n <= max_points]
    out = (
        _raw_series(session, job_id=job_id, since_step=since_step, names=small, up_to_id=up_to_id)
        if small
        else {}
    )
    for name, (n, lo, hi) in extents.items():
        if n <= max_points:
            continue
        if _is_postgresql(session):
            out[name] = _downsampled_pg(session, where=where, name=name, lo=lo, hi=hi, max_points=max_points)
        else:
            # SQLite (the embedded service): read the series and bucket it here; slower, same answer.
            raw = _raw_series(session, job_id=job_id, since_step=since_step, names=[name], up_to_id=up_to_id)
            out[name] = downsample(raw.get(name, []), max_points=max_points)
    return dict(sorted(out.items()))


def series_names(session: Session, *, job_id: str) -> list[str]:
    """The job's metric names, one index probe per name (a loose index scan) however long the series."""
    names = select(func.min(Metric.name).label("name")).where(Metric.job_id == job_id).cte(recursive=True)
    after = select(func.min(Metric.name)).where(Metric.job_id == job_id, Metric.name > names.c.name)
    names = names.union_all(select(after.scalar_subquery()).where(names.c.name.is_not(None)))
    return [n for n in session.execute(select(names.c.name)).scalars() if n is not None]


def _extent(session: Session, *, where: list[ColumnElement[bool]], cap: int) -> tuple[int, int, int]:
    """(points up to `cap`, first step, last step) of one series: index probes, never a full count."""
    capped = select(Metric.id).where(*where).limit(cap).subquery()
    stmt = select(
        select(func.count()).select_from(capped).scalar_subquery(),
        select(func.min(Metric.step)).where(*where).scalar_subquery(),
        select(func.max(Metric.step)).where(*where).scalar_subquery(),
    )
    n, lo, hi = session.execute(stmt).one()
    return int(n), int(lo or 0), int(hi or 0)


def _metric_filter(*, job_id: str, since_step: int | None, up_to_id: int | None) -> list[ColumnElement[bool]]:
    where = [Metric.job_id == job_id]
    if since_step is not None:
        where.append(Metric.step > since_step)
    if up_to_id is not None:
        where.append(Metric.id <= up_to_id)
    return where


def _raw_series(
    session: Session, *, job_id: str, since_step: int | None, names: list[str] | None, up_to_id: int | None
) -> dict[str, list[tuple[int, float]]]:
    stmt = select(Metric.name, Metric.step, Metric.value).where(
        *_metric_filter(job_id=job_id, since_step=since_step, up_to_id=up_to_id)
    )
    if names:
        stmt = stmt.where(Metric.name.in_(names))
    stmt = stmt.order_by(Metric.name, Metric.step, Metric.id)
    series: dict[str, dict[int, float]] = {}
    for name, step, value in session.execute(stmt):
        series.setdefault(name, {})[step] = value
    return {name: sorted(points.items()) for name, points in series.items()}


def bucket_of(step: int, *, lo: int, hi: int, buckets: int) -> int:
    """Which of `buckets` equal-width buckets over steps [lo, hi] holds `step` (the SQL does the same)."""
    return ((step - lo) * buckets) // (hi - lo + 1)


def downsample(points: list[tuple[int, float]], *, max_points: int) -> list[tuple[int, float]]:
    """Min and max point of each of `max_points // 2` equal-width step buckets, in step order.

    Ties go to the earliest step. The result has at most `max_points` points and always holds the
    series' global minimum and maximum.
    """
    if len(points) <= max_points:
        return points
    lo, hi, buckets = points[0][0], points[-1][0], max_points // 2
    keep: dict[int, tuple[tuple[float, int], tuple[float, int]]] = {}
    for step, value in points:
        b = bucket_of(step, lo=lo, hi=hi, buckets=buckets)
        low, high = keep.get(b, ((value, step), (value, -step)))
        keep[b] = (min(low, (value, step)), max(high, (value, -step)))
    chosen = {step: value for (value, step), _ in keep.values()}
    chosen |= {-neg: value for _, (value, neg) in keep.values()}
    return sorted(chosen.items())


def _downsampled_pg(
    session: Session, *, where: list[ColumnElement[bool]], name: str, lo: int, hi: int, max_points: int
) -> list[tuple[int, float]]:
    """`downsample` in one pass of PostgreSQL over the (job_id, name, step) index."""
    points = (
        select(Metric.step, Metric.value)
        .where(*where, Metric.name == name)
        .ext(distinct_on(Metric.step))
        # Both descending: a backward scan of (job_id, name, step, id), no sort.
        .order_by(Metric.step.desc(), Metric.id.desc())
        .subquery()
    )
    buckets = max_points // 2
    bucket = ((points.c.step - lo) * buckets) // (hi - lo + 1)
    step = cast(points.c.step, Float)
    # min(ARRAY[value, step]) compares value first, then step: the bucket's minimum, earliest first,
    # without sorting the bucket; max(ARRAY[value, -step]) the same for the maximum.
    stmt = select(
        func.min(pg_array([points.c.value, step])), func.max(pg_array([points.c.value, -step]))
    ).group_by(bucket)
    chosen: dict[int, float] = {}
    for low, high in session.execute(stmt):
        chosen[int(low[1])] = low[0]
        chosen[-int(high[1])] = high[0]
    return sorted(chosen.items())


def max_metric_id(session: Session, *, job_id: str) -> int:
    """The id of the job's newest metric point, 0 if none (the event stream's starting cursor)."""
    return int(session.execute(select(func.max(Metric.id)).where(Metric.job_id == job_id)).scalar() or 0)


def metrics_after(
    session: Session, *, job_id: str, after_id: int, limit: int
) -> Sequence[Row[int, str, int, float]]:
    """(id, name, step, value) of the job's points after `after_id`, in insertion order."""
    stmt = (
        select(Metric.id, Metric.name, Metric.step, Metric.value)
        .where(Metric.job_id == job_id, Metric.id > after_id)
        .order_by(Metric.id)
        .limit(limit)
    )
    return session.execute(stmt).all()


def checkpoints_after(session: Session, *, job_id: str, after_id: int) -> Sequence[Checkpoint]:
    """The job's checkpoint rows added after `after_id`, oldest first."""
    stmt = (
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.id > after_id)
        .order_by(Checkpoint.id)
    )
    return session.execute(stmt).scalars().all()


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


def log_tail(session: Session, *, job_id: str, rank: int | None, tail: int) -> list[LogLine]:
    """The last `tail` log lines (of one rank if given), in order."""
    stmt = select(LogLine).where(LogLine.job_id == job_id)
    if rank is not None:
        stmt = stmt.where(LogLine.rank == rank)
    rows = session.execute(stmt.order_by(LogLine.id.desc()).limit(tail)).scalars().all()
    return list(reversed(rows))


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
                # A deferred job's message was consumed on purpose: republish_deferred owns it.
                .where(Job.status == "queued", Job.updated_at < older_than, Job.quota_deferred.is_(False))
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


def purge_history(session: Session, *, finished_before: datetime, limit: int = 100) -> int:
    """Delete log lines and metric points of up to `limit` jobs finished before the cutoff.

    The job row (with its latest metrics and error), its timeline and its checkpoints stay; returns
    how many jobs lost history in this call.
    """
    has_history = or_(
        select(LogLine.id).where(LogLine.job_id == Job.id).exists(),
        select(Metric.id).where(Metric.job_id == Job.id).exists(),
    )
    ids = list(
        session.execute(
            select(Job.id)
            .where(Job.finished_at.is_not(None), Job.finished_at < finished_before, has_history)
            .limit(limit)
        ).scalars()
    )
    if ids:
        session.execute(delete(LogLine).where(LogLine.job_id.in_(ids)))
        session.execute(delete(Metric).where(Metric.job_id.in_(ids)))
    return len(ids)
