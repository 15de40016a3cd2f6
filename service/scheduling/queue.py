"""The queue's rules: priority ceilings, the queued-jobs cap, fair keys, queue positions.

Fairness: within one device kind and priority, placement takes each owner's first queued job, then
each owner's second, and so on, rather than the oldest first. A job's `fair_key`, set at submit, is
one more than the key of its owner's last queued job there, and never less than the key of the
queue's current head: a user with one job waits behind at most one job of each other user at its
priority, however many they queued. Higher `priority` still goes first, and only an admin can grant
more than 0 (`max_priority`), so nobody can jump the queue on their own.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy.orm import Session

from api_schemas import MAX_PRIORITY, JobSpec, JobStatus
from service.config import Settings
from service.errors import Conflict, Forbidden
from service.models import Job, User
from service.scheduling import queue_repository
from service.users import repository as users_repository


class QueueFull(Conflict):
    """The user already has DPTRAIN_MAX_QUEUED_PER_USER jobs queued."""


def ceiling(user: User) -> int:
    """The highest `priority` `user` may submit."""
    return MAX_PRIORITY if user.is_admin else user.max_priority


def check_priority(*, user: User, spec: JobSpec) -> None:
    """Forbidden, naming `priority` and how to be granted more, above the user's ceiling."""
    allowed = ceiling(user)
    if spec.priority > allowed:
        raise Forbidden(
            f"priority {spec.priority} is above the highest priority user {user.name} may submit, "
            f"{allowed}: an admin grants more with `dptrain users grant {user.name} --max-priority "
            f"{spec.priority}` (or PATCH /v1/users/{user.name}/permissions with max_priority)"
        )


def fair_key(session: Session, *, user: User, spec: JobSpec) -> int:
    """The fair key of a job `user` submits now (see the module's docstring)."""
    return queue_repository.fair_key(
        session, owner_id=user.id, device=spec.resources.device, priority=spec.priority
    )


def check_queue_cap(session: Session, *, user: User, settings: Settings) -> None:
    """QueueFull if the job just inserted takes `user` past DPTRAIN_MAX_QUEUED_PER_USER queued jobs.

    Called after the insert, in the submit's transaction. The owner's row lock makes the submits of
    one owner count in turn, each seeing the jobs the ones before it committed, and it is held to
    the commit: on PostgreSQL the cap is never exceeded, however many submits race (on SQLite the
    insert's database write lock does the same). Only submits of one owner wait on each other.
    """
    cap = settings.max_queued_per_user
    if cap == 0:
        return
    users_repository.lock_user(session, user_id=user.id)
    if queue_repository.queued_count(session, owner_id=user.id, up_to=cap + 1) > cap:
        raise QueueFull(
            f"user {user.name} already has {cap} jobs queued, the most DPTRAIN_MAX_QUEUED_PER_USER allows: "
            "submit again once some have started, or cancel some"
        )


def positions(session: Session, *, jobs: Iterable[Job]) -> dict[str, int]:
    """The queue position of each queued job of `jobs` that is not unplaceable (one query)."""
    ids = [j.id for j in jobs if j.status == JobStatus.QUEUED.value and not j.unplaceable]
    return queue_repository.positions(session, job_ids=ids)
