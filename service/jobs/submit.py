"""The submit gate: everything a new job must pass, decided in one place for every way a job is made.

`POST /v1/jobs`, `POST /v1/sweeps` (its base and each setting of its space that can change an
answer) and the sweep driver's trials all ask `gate`, with the service's settings always: no
argument leaves a check out. `submit` is the only code that inserts a job row, and it inserts only
what `gate` admitted (tests/test_architecture.py holds both rules). Every refusal is raised as the
API answers it: a `ServiceError` (403 grants and ceilings, 404 an `init_from` source the user may
not see, 409 a full queue or a reused key) or a 422 naming the field path.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from api_schemas import JobSpec, JobStatus
from service.config import Settings
from service.errors import Conflict
from service.jobs import init_from, lifecycle, policy, repository
from service.jobs.service import visible_owner
from service.models import Job, User
from service.scheduling import queue
from service.scheduling import service as scheduling
from service.scheduling.placement import Pending

# Where a refused code archive was named in a job's body; a sweep names its own path.
CODE_AT: tuple[str | int, ...] = ("body", "code", "sha256")


@dataclass(frozen=True)
class NewJob:
    """A spec the gate admitted: the row of its new queued job, ready to insert."""

    values: dict[str, Any]


@dataclass(frozen=True)
class Replay:
    """A keyed submit made before with the same spec: the job that submit created, as it is now."""

    job: Job


def refuse_early(body: object, *, user: User, settings: Settings) -> None:
    """The gate's grant checks on a body not yet validated (403): run before the spec's own rules.

    A user who may not set `env` (or `environment`) at all hears that, not which names or
    requirements the spec refuses; `gate` checks the validated spec again.
    """
    if isinstance(body, dict) and body.get("env"):
        policy.check_env_grant(user)
    if isinstance(body, dict) and body.get("environment") is not None:
        policy.check_environment_grant(user, settings)


def gate(
    session: Session,
    *,
    user: User,
    spec: JobSpec,
    settings: Settings,
    key: str | None = None,
    code_at: tuple[str | int, ...] = CODE_AT,
) -> NewJob | Replay:
    """Every check a new job of `user` must pass: its row (or the earlier job of `key`), else the refusal.

    Every rule of the spec itself ran when it was validated; left are this server's and this user's:
    the code it may run (DPTRAIN_USER_CODE, the grant, the allow-list, the archive, `env`,
    `environment`), its data paths, the owner's priority ceiling and the `init_from` source. The
    queued-jobs cap is counted by `submit`, after the insert, under the owner's lock.
    """
    policy.check_user_code(session, user=user, spec=spec, settings=settings, code_at=code_at)
    policy.check_data_paths(spec=spec, settings=settings)
    queue.check_priority(user=user, spec=spec)
    stored = _stored(spec)
    if key is not None:
        # Looked up before the source of an `init_from` is: a replay answers the earlier job even
        # once that checkpoint is pruned or the source is no longer readable. The unique
        # (owner_id, idempotency_key) still decides between racers (`submit`).
        earlier = repository.by_idempotency_key(session, owner_id=user.id, key=key)
        if earlier is not None:
            return Replay(_replayed(earlier, key=key, request_hash=spec_hash(stored)))
    job_id = uuid.uuid4().hex
    needs = spec.resources
    pending = Pending(
        job_id=job_id,
        owner_id=user.id,
        device=needs.device,
        nodes=needs.nodes,
        processes_per_node=needs.processes_per_node,
    )
    # Said in the submit's answer at once, rather than only after the next placement round.
    never = scheduling.unplaceable_reason(session, job=pending, settings=settings)
    values: dict[str, Any] = {
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
    if key is not None:
        values |= {"idempotency_key": key, "request_hash": spec_hash(stored)}
    return NewJob(values)


def submit(
    session: Session, *, user: User, spec: JobSpec, settings: Settings, key: str | None = None
) -> tuple[Job, bool]:
    """Gate a spec and record its job queued: (job, True) if created now, (the earlier job, False) if not.

    Under an `Idempotency-Key` the unique (owner_id, idempotency_key) decides, not the read before:
    of concurrent retries one insert wins, the others wait for it to commit and then read it.
    Conflict if the key was used with another spec. The caller kicks placement after the commit.
    """
    admitted = gate(session, user=user, spec=spec, settings=settings, key=key)
    if isinstance(admitted, Replay):
        return admitted.job, False
    job = repository.insert_job(session, values=admitted.values)
    if job is None:
        assert key is not None  # only a keyed insert can conflict
        earlier = repository.by_idempotency_key(session, owner_id=user.id, key=key)
        if earlier is None:  # the winner rolled back after all: never happens without a crash; retry
            raise Conflict(f"a submit with Idempotency-Key {key!r} is in flight; retry")
        return _replayed(earlier, key=key, request_hash=admitted.values["request_hash"]), False
    lifecycle.record_created(session, job=job)
    session.flush()
    # Counted after the insert, in this transaction, under the owner's row lock (see check_queue_cap);
    # a replay adds no job, so only a job created now counts.
    queue.check_queue_cap(session, user=user, settings=settings)
    init_from.pin_for(session, job=job, artifacts=settings.artifacts)
    return job, True


def spec_hash(stored: dict[str, Any]) -> str:
    """sha256 of a spec's canonical JSON as stored, so equal specs hash equal however written."""
    canonical = json.dumps(stored, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _stored(spec: JobSpec) -> dict[str, Any]:
    stored = spec.model_dump(mode="json")
    # Store every effective hyperparameter, recipe extras' defaults included, so the spec a job
    # shows is exactly what ran, whatever later versions choose as defaults. (A command's are only
    # those the user sent: it uses none of the defaults, see JobSpec's serializer.)
    if (params := spec.recipe_params()) is not None:
        stored["hyperparameters"].update(params.model_dump(mode="json"))
    return stored


def _init_values(
    session: Session, *, user: User, spec: JobSpec, job_id: str, settings: Settings
) -> dict[str, Any]:
    """The new job's init_* columns (service/jobs/init_from.py): 404 for a source the user may not see."""
    if spec.init_from is None:
        return {}
    return init_from.row_values(
        session,
        owner_id=visible_owner(user),
        init=spec.init_from,
        job_id=job_id,
        artifacts=settings.artifacts,
    )


def _replayed(job: Job, *, key: str, request_hash: str) -> Job:
    if job.request_hash != request_hash:
        raise Conflict(f"Idempotency-Key {key!r} was already used for job {job.id} with another spec")
    return job
