"""Every SQL query of the jobs domain."""

from __future__ import annotations

import base64
import json
import operator
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    LargeBinary,
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
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from api_schemas import JobStatus
from service.db import insert_for, is_postgresql
from service.jobs import metrics_repository, rollups_repository
from service.models import Checkpoint, Job, JobTransition, LogLine, Metric, RankStacks, User
from service.scheduling import queue_repository


def encode_cursor(job: Job) -> str:
    """An opaque keyset cursor: the (created_at, id) of the last row of a page."""
    raw = json.dumps([job.created_at.isoformat(), job.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """Inverse of encode_cursor; ValueError on anything malformed."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, job_id = json.loads(raw)
        if "\x00" in str(job_id):  # PostgreSQL refuses NUL in text even to compare with it
            raise ValueError("NUL in the cursor's job id")
        return datetime.fromisoformat(created), str(job_id)
    except Exception as exc:  # noqa: BLE001 - any decoding problem is the client's bad cursor
        raise ValueError("malformed cursor") from exc


def get(session: Session, *, job_id: str, owner_id: int | None = None) -> Job | None:
    """A job by id, optionally only if it belongs to `owner_id`."""
    stmt = select(Job).where(Job.id == job_id)
    if owner_id is not None:
        stmt = stmt.where(Job.owner_id == owner_id)
    return session.execute(stmt).scalar_one_or_none()


def get_with_owner_name(
    session: Session, *, job_id: str, owner_id: int | None = None
) -> tuple[Job, str, int | None] | None:
    """A job by id with its owner's name and its queue position, in one query; optionally only if
    it belongs to `owner_id`."""
    stmt = (
        select(Job, User.name, queue_repository.position_of_job())
        .join(User, User.id == Job.owner_id)
        .where(Job.id == job_id)
    )
    if owner_id is not None:
        stmt = stmt.where(Job.owner_id == owner_id)
    row = session.execute(stmt).first()
    return None if row is None else (row[0], row[1], row[2])


def insert_job(session: Session, *, values: dict[str, Any]) -> Job | None:
    """Insert a job row; None if its (owner_id, idempotency_key) is taken (the unique constraint decides).

    On PostgreSQL a conflicting insert waits for the other transaction to commit or roll back, so
    None means the winner is committed and readable by the next statement.
    """
    # One statement per dialect, built once, with the row as parameters: `.values(**row)` made a
    # new statement per submit whose cache key SQLAlchemy had to work out from the values each time.
    dialect = session.get_bind().dialect.name
    if dialect not in _INSERT_JOB:
        _INSERT_JOB[dialect] = (
            insert_for(session, Job)
            .on_conflict_do_nothing(index_elements=[Job.owner_id, Job.idempotency_key])
            # The whole row back as an ORM object: no second round trip to load what was just written.
            .returning(Job)
        )
    return session.execute(_INSERT_JOB[dialect], values).scalar_one_or_none()


_INSERT_JOB: dict[str, Any] = {}


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


def list_page(
    session: Session,
    *,
    owner_id: int | None,
    limit: int,
    after: tuple[datetime, str] | None,
    status: JobStatus | None,
    labels: dict[str, str] | None = None,
    updated_since: datetime | None = None,
) -> Sequence[Job]:
    """One page of jobs, newest first, by keyset on (created_at, id)."""
    stmt = select(Job)
    if owner_id is not None:
        stmt = stmt.where(Job.owner_id == owner_id)
    if status is not None:
        stmt = stmt.where(Job.status == status.value)
    if updated_since is not None:
        stmt = stmt.where(Job.updated_at > updated_since)
    if labels:
        if is_postgresql(session):
            # `@>` is what the GIN (jsonb_path_ops) index of migration 0002 serves.
            stmt = stmt.where(type_coerce(Job.labels, JSONB).contains(labels))
        else:
            stmt = stmt.where(*(Job.labels[k].as_string() == v for k, v in labels.items()))
    if after is not None:
        created, job_id = after
        stmt = stmt.where(or_(Job.created_at < created, and_(Job.created_at == created, Job.id < job_id)))
    stmt = stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    return list(session.execute(stmt).scalars().all())


def request_cancel(session: Session, *, job_id: str, prune: bool = False) -> None:
    """Flag a running job for its worker to stop (a request, not a state change); `prune`: ends `pruned`."""
    values = {"cancel_requested": True} | ({"prune_requested": True} if prune else {})
    session.execute(update(Job).where(Job.id == job_id).values(**values))


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


def checkpoint_of_step(session: Session, *, job_id: str, step: int) -> Checkpoint | None:
    """A job's checkpoint of `step`."""
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
    return session.execute(stmt).scalar_one_or_none()


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
    # A terminal job keeps its last token: it is the status that fences every node out then.
    owned = (Job.id == job_id, Job.claim_token == claim_token, Job.status == JobStatus.RUNNING.value)
    if not values:
        return session.execute(select(Job.id).where(*owned)).first() is not None
    stmt = update(Job).where(*owned).values(**values)
    return (session.execute(stmt).rowcount or 0) > 0  # type: ignore[attr-defined]


def cancel_requested(session: Session, *, job_id: str) -> bool:
    """Whether someone asked this job to stop."""
    return bool(session.execute(select(Job.cancel_requested).where(Job.id == job_id)).scalar_one())


def add_metrics(session: Session, *, rows: list[dict[str, Any]]) -> None:
    """Insert metric points, in order, and bring the rollups of the blocks they touch up to date."""
    if not rows:
        return
    jobs = sorted({row["job_id"] for row in rows})
    before = {job_id: metrics_repository.max_metric_id(session, job_id=job_id) for job_id in jobs}
    if is_postgresql(session):
        _copy_metrics(session, rows=rows)
    else:
        session.execute(insert(Metric), rows)  # an executemany: one INSERT per row, in order
    for job_id in jobs:
        rollups_repository.record(
            session,
            job_id=job_id,
            rows=[row for row in rows if row["job_id"] == job_id],
            before_id=before[job_id],
            max_id=metrics_repository.max_metric_id(session, job_id=job_id),
        )


def _copy_metrics(session: Session, *, rows: list[dict[str, Any]]) -> None:
    """COPY points into the session's transaction: rows keep their order, so ids follow it.

    COPY streams the rows in one command. An executemany pipelines one INSERT per row, each parsed
    and planned by the server, and a multi-row VALUES makes psycopg convert a long statement's
    parameters in Python on every execution: both cost more per point.
    """
    driver = session.connection().connection.driver_connection
    assert driver is not None, "the session's connection is open"
    columns = ("job_id", "attempt", "name", "step", "value")
    sql = f"COPY {Metric.__tablename__} ({', '.join(columns)}) FROM STDIN"
    fields = operator.itemgetter(*columns)
    with driver.cursor() as cursor, cursor.copy(sql) as copy:
        for row in rows:
            copy.write_row(fields(row))


def add_log_lines(session: Session, *, rows: list[dict[str, Any]]) -> None:
    """Insert log lines in one statement."""
    if rows:
        session.execute(insert(LogLine), rows)


def stored_log_bytes(session: Session, *, job_id: str) -> int:
    """The bytes (UTF-8) of every log line the job has stored, all attempts together."""
    if is_postgresql(session):
        size = func.octet_length(LogLine.line)
    else:
        # SQLite's length() counts characters; of a blob, bytes (a cast only relabels the UTF-8).
        size = func.length(cast(LogLine.line, LargeBinary))
    stmt = select(func.coalesce(func.sum(size), 0)).where(LogLine.job_id == job_id)
    return int(session.execute(stmt).scalar_one())


def stored_metric_points(session: Session, *, job_id: str) -> int:
    """How many metric points the job has stored, all attempts together."""
    stmt = select(func.count()).select_from(Metric).where(Metric.job_id == job_id)
    return int(session.execute(stmt).scalar_one())


def upsert_checkpoint(session: Session, *, row: dict[str, Any]) -> None:
    """Record a checkpoint; a later attempt that rewrites the same step replaces the row.

    A row with `best` true becomes the job's only best one.
    """
    session.execute(
        delete(Checkpoint).where(Checkpoint.job_id == row["job_id"], Checkpoint.step == row["step"])
    )
    session.execute(insert(Checkpoint), [row])
    if row.get("best"):
        mark_best_checkpoint(session, job_id=row["job_id"], step=row["step"])


def mark_best_checkpoint(session: Session, *, job_id: str, step: int | None) -> None:
    """Make the checkpoint of `step` the job's best and no other (None: none is)."""
    # Only rows whose flag changes are written: a sync that finds the marks right touches nothing.
    session.execute(
        update(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.best != (Checkpoint.step == step))
        .values(best=Checkpoint.step == step)
    )


def delete_checkpoints(session: Session, *, job_id: str, steps: list[int]) -> None:
    """Forget the checkpoints of `steps`, whose files the engine removed (keep_last)."""
    if steps:
        session.execute(delete(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step.in_(steps)))


def purge_history(session: Session, *, finished_before: datetime, limit: int = 100) -> int:
    """Delete log lines, stack dumps, metrics and rollups of up to `limit` jobs finished before the cutoff.

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
        # A stack dump is a log of its own (its lines are in the log too: a job with one has lines).
        session.execute(delete(RankStacks).where(RankStacks.job_id.in_(ids)))
        rollups_repository.delete_for_jobs(session, job_ids=ids)
        session.execute(delete(Metric).where(Metric.job_id.in_(ids)))
    return len(ids)
