"""The rules of the jobs domain: submission, visibility, cancellation. Services only flush."""

from __future__ import annotations

import hashlib
import json
import uuid
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
    JobSpec,
    JobStatus,
    Progress,
    Timeline,
    Transition,
)
from service.config import Settings
from service.errors import Conflict, InvalidTransition, NotFound
from service.etag import etag_of_version
from service.jobs import init_from, lifecycle, repository, stored
from service.jobs.stored import INVALID_SPEC
from service.models import Checkpoint, User
from service.models import Job as JobRow
from service.scheduling import queue
from service.scheduling import service as scheduling
from service.scheduling.placement import Pending


def _visible_owner(user: User) -> int | None:
    # Admins see every job; everyone else only their own.
    return None if user.is_admin else user.id


def can_see(user: User, *, owner_id: int) -> bool:
    """Whether `user` may see a job of `owner_id` (what `get_visible` checks in its query)."""
    return _visible_owner(user) in (None, owner_id)


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


def _stored(spec: JobSpec) -> dict[str, Any]:
    stored = spec.model_dump(mode="json")
    # Store every effective hyperparameter, recipe extras' defaults included, so the spec a job
    # shows is exactly what ran, whatever later versions choose as defaults. (A command's are only
    # those the user sent: it uses none of the defaults, see JobSpec's serializer.)
    if (params := spec.recipe_params()) is not None:
        stored["hyperparameters"].update(params.model_dump(mode="json"))
    return stored


def _row_values(session: Session, *, user: User, spec: JobSpec, settings: Settings | None) -> dict[str, Any]:
    stored = _stored(spec)
    job_id = uuid.uuid4().hex
    queue.check_priority(user=user, spec=spec)
    never = None
    if settings is not None:
        # Said in the submit's answer at once, rather than only after the next placement round.
        needs = spec.resources
        pending = Pending(
            job_id=job_id,
            owner_id=user.id,
            device=needs.device,
            nodes=needs.nodes,
            processes_per_node=needs.processes_per_node,
        )
        never = scheduling.unplaceable_reason(session, job=pending, settings=settings)
    return {
        **_init_values(session, user=user, spec=spec, job_id=job_id, settings=settings),
        "id": job_id,
        "name": spec.name,
        "owner_id": user.id,
        "status": JobStatus.QUEUED.value,
        "spec": stored,
        "priority": spec.priority,
        "device": spec.resources.device,
        "fair_key": queue.fair_key(session, user=user, spec=spec),
        "labels": dict(spec.labels),
        "total_steps": spec.progress_total,
        "max_restarts": spec.max_restarts,
        "latest_metrics": {},
        "unplaceable": never is not None,
        "queued_reason": never,
    }


def _init_values(
    session: Session, *, user: User, spec: JobSpec, job_id: str, settings: Settings | None
) -> dict[str, Any]:
    """The new job's init_* columns (service/jobs/init_from.py): 404 for a source the user may not see."""
    if spec.init_from is None:
        return {}
    if settings is None:
        raise ValueError("init_from needs the service's settings (the artifact root its pin goes under)")
    return init_from.row_values(
        session,
        owner_id=_visible_owner(user),
        init=spec.init_from,
        job_id=job_id,
        artifacts=settings.artifacts,
    )


def _pin(session: Session, *, job: JobRow, settings: Settings | None) -> None:
    if settings is not None:
        init_from.pin_for(session, job=job, artifacts=settings.artifacts)


def spec_hash(stored: dict[str, Any]) -> str:
    """sha256 of a spec's canonical JSON as stored, so equal specs hash equal however written."""
    canonical = json.dumps(stored, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def submit(session: Session, *, user: User, spec: JobSpec, settings: Settings | None = None) -> JobRow:
    """Record a new queued job (the caller kicks placement once the transaction has committed)."""
    # With `settings` (the API always passes them) a job that no set of live nodes could ever hold
    # is recorded unplaceable at once (without them, placement's next round finds it so), and the
    # owner's queued-jobs cap holds. Forbidden above the user's priority ceiling either way.
    job, _ = _insert(session, values=_row_values(session, user=user, spec=spec, settings=settings))
    assert job is not None
    if settings is not None:
        queue.check_queue_cap(session, user=user, settings=settings)
    _pin(session, job=job, settings=settings)
    return job


def submit_once(
    session: Session, *, user: User, spec: JobSpec, key: str, settings: Settings | None = None
) -> tuple[JobRow, bool]:
    """Submit under an `Idempotency-Key`: (job, True) if created now, (the earlier job, False) on a replay.

    The unique (owner_id, idempotency_key) decides, not a read-then-write: of concurrent retries one
    insert wins, the others wait for it to commit and then read it. Conflict if the key was used
    with another spec. A replay answers the earlier job as it is now (its `unplaceable` included).
    """
    if spec.init_from is not None:
        # A replay answers the earlier job even once the source's checkpoint is pruned or the source
        # is no longer readable: look first (the unique constraint still decides between racers).
        earlier = repository.by_idempotency_key(session, owner_id=user.id, key=key)
        if earlier is not None:
            return _replayed(earlier, key=key, request_hash=spec_hash(_stored(spec))), False
    values = _row_values(session, user=user, spec=spec, settings=settings)
    values |= {"idempotency_key": key, "request_hash": spec_hash(values["spec"])}
    job, created = _insert(session, values=values)
    if created and settings is not None:
        # A replay adds no job, so only a job created now counts against the cap.
        queue.check_queue_cap(session, user=user, settings=settings)
    if created:
        assert job is not None
        _pin(session, job=job, settings=settings)
    if job is None:
        job = repository.by_idempotency_key(session, owner_id=user.id, key=key)
        if job is None:  # the winner rolled back after all: never happens without a crash; retry
            raise Conflict(f"a submit with Idempotency-Key {key!r} is in flight; retry")
    return _replayed(job, key=key, request_hash=values["request_hash"]), created


def _replayed(job: JobRow, *, key: str, request_hash: str) -> JobRow:
    if job.request_hash != request_hash:
        raise Conflict(f"Idempotency-Key {key!r} was already used for job {job.id} with another spec")
    return job


def _insert(session: Session, *, values: dict[str, Any]) -> tuple[JobRow | None, bool]:
    job = repository.insert_job(session, values=values)
    if job is None:
        return None, False
    lifecycle.record_created(session, job=job)
    session.flush()
    return job, True


def get_visible(session: Session, *, user: User, job_id: str) -> JobRow:
    """A job the user may see, or NotFound (never revealing that another's job exists)."""
    job = repository.get(session, job_id=job_id, owner_id=_visible_owner(user))
    if job is None:
        raise NotFound(f"job {job_id!r} not found")
    return job


def get_visible_with_owner(session: Session, *, user: User, job_id: str) -> tuple[JobRow, str, int | None]:
    """A job the user may see, its owner's name and its queue position (one query), or NotFound."""
    found = repository.get_with_owner_name(session, job_id=job_id, owner_id=_visible_owner(user))
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
        owner_id=_visible_owner(user),
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
