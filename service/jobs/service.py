"""The rules of the jobs domain: visibility, presentation, cancellation. Services only flush.

A submit's rules are the submit gate's (service/jobs/submit.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from api_schemas import (
    CheckpointInfo,
    InitCheckpoint,
    Job,
    JobError,
    JobList,
    JobStatus,
    Progress,
    Timeline,
    Transition,
)
from service.errors import InvalidTransition, NotFound
from service.etag import etag_of_version
from service.jobs import lifecycle, repository, stored
from service.jobs.stored import INVALID_SPEC
from service.models import Checkpoint, User
from service.models import Job as JobRow
from service.scheduling import queue


def visible_owner(user: User) -> int | None:
    """The owner whose jobs `user` may see (and start from): None for an admin, who sees every job."""
    return None if user.is_admin else user.id


def can_see(user: User, *, owner_id: int) -> bool:
    """Whether `user` may see a job of `owner_id` (what `get_visible` checks in its query)."""
    return visible_owner(user) in (None, owner_id)


def to_schema(job: JobRow, *, owner: str, position: int | None = None) -> Job:
    """The wire form of a job row (`position`: its queue position); a bad stored spec shows as its error."""
    spec, problem = stored.shown_spec(job.spec, name=job.name)
    error = stored.shown_error(job.error)
    if error is None and problem is not None:
        error = JobError(type=INVALID_SPEC, message=problem)
    queued = job.status == JobStatus.QUEUED.value
    unplaceable = queued and job.unplaceable
    fields: dict[str, Any] = dict(
        id=job.id,
        name=job.name,
        status=JobStatus(job.status),
        spec=spec,
        owner=owner,
        created_at=job.created_at,
        updated_at=job.updated_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        progress=Progress(step=job.step, total_steps=job.total_steps),
        attempt=job.attempt,
        cancel_requested=job.cancel_requested,
        error=error,
        latest_metrics=stored.shown_metrics(job.latest_metrics),
        queued_reason=job.queued_reason if queued else None,
        queue_position=position if queued else None,
        unplaceable=unplaceable,
        # The reason of an unplaceable job is placement.never_fits's sentence: the warning itself.
        warnings=[job.queued_reason] if unplaceable and job.queued_reason else [],
        init_checkpoint=_init_checkpoint(job),
        environment_build=stored.shown_environment(job.environment_state),
    )
    try:
        return Job(**fields)
    except ValidationError:
        if problem is None:
            raise
        # shown_spec's last resort is built without validation (nothing of the stored spec passed
        # the spec's own checks), and so is the job around it; every other field is a typed column.
        return Job.model_construct(**fields)


def _init_checkpoint(job: JobRow) -> InitCheckpoint | None:
    if job.init_job is None or job.init_step is None or job.init_sha256 is None:
        return None
    return InitCheckpoint(job=job.init_job, step=job.init_step, sha256=job.init_sha256)


def get_visible(session: Session, *, user: User, job_id: str) -> JobRow:
    """A job the user may see, or NotFound (never revealing that another's job exists)."""
    job = repository.get(session, job_id=job_id, owner_id=visible_owner(user))
    if job is None:
        raise NotFound(f"job {job_id!r} not found")
    return job


def get_visible_with_owner(session: Session, *, user: User, job_id: str) -> tuple[JobRow, str, int | None]:
    """A job the user may see, its owner's name and its queue position (one query), or NotFound."""
    found = repository.get_with_owner_name(session, job_id=job_id, owner_id=visible_owner(user))
    if found is None:
        raise NotFound(f"job {job_id!r} not found")
    return found


def queue_position(session: Session, *, job: JobRow) -> int | None:
    """The job's queue position while it is queued and placeable (docs/api.md); else None."""
    return queue.positions(session, jobs=[job]).get(job.id)


# Part of every job ETag: bump it whenever the JSON of an unchanged row changes (a field added to
# `Job`, another rendering of one), so clients holding an old ETag get the new body.
JOB_REPRESENTATION = 4


def job_etag(job: JobRow, *, owner: str, position: int | None = None) -> str:
    """The ETag of a job's JSON, from its row version rather than its body (which a 304 never builds).

    `updated_at` moves with every UPDATE of the row (an `onupdate`, or set explicitly), so it
    versions every field of the answer; status, step, attempt and `cancel_requested` are added so
    that even two writes within one microsecond of each other give different tags. A queued job's
    `position` moves without its row changing (other jobs start, leave or arrive), so it is part too.
    """
    return etag_of_version(
        JOB_REPRESENTATION,
        job.id,
        job.updated_at.isoformat(),
        job.status,
        job.step,
        job.attempt,
        job.cancel_requested,
        owner,
        position,
    )


def present(session: Session, *, jobs: Sequence[JobRow]) -> list[Job]:
    """Wire forms of several jobs with their owners' names in one query."""
    names = repository.owner_names(session, owner_ids={j.owner_id for j in jobs})
    places = queue.positions(session, jobs=jobs)
    return [to_schema(j, owner=names.get(j.owner_id, "?"), position=places.get(j.id)) for j in jobs]


def list_jobs(
    session: Session,
    *,
    user: User,
    limit: int,
    cursor: str | None,
    status: JobStatus | None,
    labels: dict[str, str] | None = None,
    updated_since: datetime | None = None,
) -> JobList:
    """A page of the jobs the user may see, newest first."""
    after = repository.decode_cursor(cursor) if cursor else None
    if updated_since is not None and updated_since.tzinfo is None:
        updated_since = updated_since.replace(tzinfo=UTC)  # a time without offset means UTC
    rows = repository.list_page(
        session,
        owner_id=visible_owner(user),
        limit=limit + 1,
        after=after,
        status=status,
        labels=labels,
        updated_since=updated_since,
    )
    page, more = list(rows[:limit]), len(rows) > limit
    return JobList(
        items=present(session, jobs=page), next_cursor=repository.encode_cursor(page[-1]) if more else None
    )


def cancel(session: Session, *, user: User, job_id: str) -> JobRow:
    """Cancel a job: a queued one at once, a running one by asking its worker to stop it."""
    job = get_visible(session, user=user, job_id=job_id)
    status = JobStatus(job.status)
    if status.is_terminal():
        raise InvalidTransition(f"job {job_id!r} is already {status.value}")
    if status is JobStatus.QUEUED:
        done = lifecycle.transition(
            session,
            job_id=job_id,
            src=JobStatus.QUEUED,
            dst=JobStatus.CANCELLED,
            reason=f"cancelled by {user.name}",
        )
        if done is not None:
            return done
        # Placement started it in between: fall through and ask its nodes to stop.
    repository.request_cancel(session, job_id=job_id)
    session.flush()
    session.refresh(job)
    return job


def checkpoint_infos(rows: Sequence[Checkpoint]) -> list[CheckpointInfo]:
    """Wire forms of checkpoint rows."""
    return [
        CheckpointInfo(
            id=c.id,
            step=c.step,
            created_at=c.created_at,
            size_bytes=c.size_bytes,
            sha256=c.sha256,
            best=c.best,
        )
        for c in rows
    ]


def get_checkpoint(session: Session, *, user: User, job_id: str, checkpoint_id: int) -> Checkpoint:
    """A checkpoint of a visible job, or NotFound."""
    get_visible(session, user=user, job_id=job_id)
    ckpt = repository.checkpoint(session, job_id=job_id, checkpoint_id=checkpoint_id)
    if ckpt is None:
        raise NotFound(f"checkpoint {checkpoint_id} of job {job_id!r} not found")
    return ckpt


def parse_labels(pairs: list[str]) -> dict[str, str]:
    """`key=value` filters as a dict; ValueError naming the first malformed one."""
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"label filter {pair!r} is not key=value")
        labels[key] = value
    return labels


def timeline(session: Session, *, user: User, job_id: str) -> Timeline:
    """The status changes of a visible job, oldest first."""
    get_visible(session, user=user, job_id=job_id)
    rows = repository.transitions(session, job_id=job_id)
    return Timeline(
        items=[
            Transition(
                at=t.at,
                from_status=JobStatus(t.from_status) if t.from_status else None,
                to_status=JobStatus(t.to_status),
                attempt=t.attempt,
                reason=t.reason,
            )
            for t in rows
        ]
    )
