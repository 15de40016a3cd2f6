"""The job lifecycle in one place: the only code that writes `jobs.status`."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import ColumnElement, ScalarSelect, case, func, insert, select, update
from sqlalchemy.orm import Session

from api_schemas import JobStatus
from service.models import Checkpoint, Job, JobTransition
from service.models.base import utcnow
from service.scheduling import repository as placement
from service.webhooks import outbox

# Which states a job may move to from each state. A running job returns to `queued` only to be
# restarted (a later issue); terminal states go nowhere.
ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.CANCELLED, JobStatus.FAILED}),
    JobStatus.RUNNING: frozenset(
        {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.PRUNED, JobStatus.QUEUED}
    ),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
    JobStatus.PRUNED: frozenset(),
}


def can_transition(src: JobStatus, dst: JobStatus) -> bool:
    """Whether a job may move from `src` to `dst`."""
    return dst in ALLOWED[src]


def transition(
    session: Session,
    *,
    job_id: str,
    src: JobStatus,
    dst: JobStatus,
    reason: str | None = None,
    claim_token: str | None = None,
    values: dict[str, Any] | None = None,
    conditions: Sequence[ColumnElement[bool]] = (),
) -> Job | None:
    """Move a job from `src` to `dst` with one conditional UPDATE; None if it was not in `src`.

    The WHERE clause on the current status (and, for a worker, its fencing token) makes this
    safe against races: of two concurrent callers only one sees its row updated. Leaving `running`
    frees every node the attempt was placed on, in the same transaction.
    """
    if not can_transition(src, dst):
        raise ValueError(f"illegal job transition {src.value} -> {dst.value}")
    now = utcnow()
    fields: dict[str, Any] = {"status": dst.value, "updated_at": now, **(values or {})}
    if dst.is_terminal():
        fields.setdefault("finished_at", now)
    stmt = update(Job).where(Job.id == job_id, Job.status == src.value, *conditions)
    if claim_token is not None:
        stmt = stmt.where(Job.claim_token == claim_token)
    job = session.execute(stmt.values(**fields).returning(Job)).scalar_one_or_none()
    if job is None:
        return None
    if src is JobStatus.RUNNING:
        placement.release_job(session, job_id=job_id)
    session.execute(
        insert(JobTransition).values(
            job_id=job_id,
            at=now,
            from_status=src.value,
            to_status=dst.value,
            attempt=job.attempt,
            reason=reason,
        )
    )
    change = outbox.Change(
        job_id=job_id,
        owner_id=job.owner_id,
        name=job.name,
        src=src.value,
        dst=dst.value,
        reason=reason,
        at=now,
        attempt=job.attempt,
        error=job.error,
    )
    outbox.record(session, [change])
    return job


def note_running(session: Session, *, job_id: str, attempt: int, note: str) -> None:
    """Add `note` to the reason of the timeline entry that started `attempt` (what its start could not do)."""
    # A note on the entry rather than an entry of its own: the timeline stays one row per status change.
    started = (
        select(func.max(JobTransition.id))
        .where(
            JobTransition.job_id == job_id,
            JobTransition.attempt == attempt,
            JobTransition.to_status == JobStatus.RUNNING.value,
        )
        .scalar_subquery()
    )
    reason = func.coalesce(JobTransition.reason + "; ", "") + note
    session.execute(update(JobTransition).where(JobTransition.id == started).values(reason=reason))


def end_of_cancelled_run(*, finished: bool, pruned: bool = False) -> tuple[JobStatus, str]:
    """How a running job whose cancel was requested ends: `succeeded` if its work finished first.

    `pruned`: the cancel was its sweep's pruner's (`jobs.prune_requested`), which ends it `pruned`.
    """
    # `finished`: every step ran and the final checkpoint is written (the engine's finished event
    # follows both), or a command exited 0 before it was stopped. A cancel that comes after that has
    # nothing left to stop; recording `cancelled` would hide a complete model behind a word that
    # says there is none. `cancel_requested` stays true on such a job: the timeline says why.
    if finished:
        return JobStatus.SUCCEEDED, "finished before the cancel took effect"
    if pruned:
        return JobStatus.PRUNED, "pruned by its sweep"
    return JobStatus.CANCELLED, "cancel requested"


def prune_requested(session: Session, *, job_id: str) -> bool:
    """Whether the job's cancel is its sweep's pruner's."""
    return bool(session.scalar(select(Job.prune_requested).where(Job.id == job_id)))


def record_created(session: Session, *, job: Job) -> None:
    """The first entry of a job's timeline."""
    # A plain INSERT rather than session.add(): the unit of work's flush costs more than the row.
    session.execute(
        insert(JobTransition),
        {"job_id": job.id, "at": job.created_at, "from_status": None, "to_status": job.status, "attempt": 0},
    )
    change = outbox.Change(
        job_id=job.id,
        owner_id=job.owner_id,
        name=job.name,
        src=None,
        dst=job.status,
        reason=None,
        at=job.created_at,
        attempt=0,
    )
    outbox.record(session, [change])


def claim(session: Session, *, job_id: str, worker: str, reason: str | None = None) -> Job | None:
    """Start a new attempt of one queued job (`claim_many` of one); its row now, None if it is not queued."""
    if not claim_many(session, workers={job_id: worker}, reasons={job_id: reason or f"placed on {worker}"}):
        return None
    return session.get(Job, job_id, populate_existing=True)


def claim_many(session: Session, *, workers: Mapping[str, str], reasons: Mapping[str, str]) -> dict[str, int]:
    """Start a new attempt of each queued job in `workers` (job id -> node 0) in one guarded UPDATE.

    What placement calls for the jobs a round places (`worker` being each one's node 0): one UPDATE and one
    INSERT of their timeline rows instead of two round trips a job, which were most of a busy
    round's time. The same guard (each row only while still `queued`); returns the attempt of each
    job claimed, so a job cancelled since it was read is simply left out.
    """
    if not workers:
        return {}
    now = utcnow()
    ids = list(workers)
    # A fresh fencing token and node 0 per job, chosen by id within the one statement.
    tokens = {job_id: uuid.uuid4().hex for job_id in ids}
    stmt = (
        update(Job)
        .where(Job.id.in_(ids), Job.status == JobStatus.QUEUED.value)
        .values(
            status=JobStatus.RUNNING.value,
            updated_at=now,
            attempt=Job.attempt + 1,
            claim_token=case(tokens, value=Job.id),
            worker=case(dict(workers), value=Job.id),
            started_at=now,
            error=None,
            queued_reason=None,
            unplaceable=False,
        )
        .returning(Job.id, Job.attempt, Job.owner_id, Job.name)
        # Columns returned, not entities, and no Job of these rows is held by a placement round's
        # session: nothing in its identity map to bring up to date.
        .execution_options(synchronize_session=False)
    )
    rows = session.execute(stmt).all()
    claimed = {job_id: attempt for job_id, attempt, _owner, _name in rows}
    if claimed:
        session.execute(
            insert(JobTransition),
            [
                {
                    "job_id": job_id,
                    "at": now,
                    "from_status": JobStatus.QUEUED.value,
                    "to_status": JobStatus.RUNNING.value,
                    "attempt": attempt,
                    "reason": reasons.get(job_id),
                }
                for job_id, attempt in claimed.items()
            ],
        )
        changes = [
            outbox.Change(
                job_id=job_id,
                owner_id=owner_id,
                name=name,
                src=JobStatus.QUEUED.value,
                dst=JobStatus.RUNNING.value,
                reason=reasons.get(job_id),
                at=now,
                attempt=attempt,
            )
            for job_id, attempt, owner_id, name in rows
        ]
        outbox.record(session, changes)
    return claimed


def resume_step(job_id: str) -> ScalarSelect[int]:
    """SQL for the step a restarted job resumes from: its newest checkpoint's, 0 without one.

    A requeued job shows this as its progress: the steps after its last checkpoint are lost and will
    be trained again, so the progress the dead attempt reported would overstate it.
    """
    newest = func.coalesce(func.max(Checkpoint.step), 0)
    return select(newest).where(Checkpoint.job_id == job_id).scalar_subquery()
