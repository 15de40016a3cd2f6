"""The per-user limit on running jobs: the claim's conditional UPDATE and the republishing of deferred jobs.

Its queries live here rather than in repository.py (already near the house limit of ~400 lines);
lifecycle.claim is still the only place that moves a job to `running`.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, ScalarSelect, and_, func, select, update
from sqlalchemy.orm import Session, aliased

from service.models import Job, User


def lock_owner(session: Session, *, job_id: str) -> int | None:
    """Lock the job owner's user row until this transaction ends; returns the owner id.

    Claims of one owner's jobs take this lock first, so they count that owner's running jobs one
    after another: under READ COMMITTED two concurrent claims could otherwise both count 3 of 4
    and both pass. FOR NO KEY UPDATE does not block inserts of jobs referencing the user.
    """
    if session.get_bind().dialect.name != "postgresql":
        return None  # SQLite has one writer at a time: the claim's UPDATE alone is atomic
    owner = select(Job.owner_id).where(Job.id == job_id).scalar_subquery()
    stmt = select(User.id).where(User.id == owner).with_for_update(key_share=False)
    return session.execute(stmt).scalar_one_or_none()


def _running_of_owner() -> ScalarSelect[int]:
    other = aliased(Job)
    return (
        select(func.count())
        .select_from(other)
        .where(other.owner_id == Job.owner_id, other.status == "running")
        .scalar_subquery()
    )


def under_limit(max_running: int) -> ColumnElement[bool]:
    """SQL: the job's owner has fewer than `max_running` jobs running (for a conditional UPDATE on jobs)."""
    return _running_of_owner() < max_running


def defer(session: Session, *, job_id: str) -> bool:
    """Mark a still-queued job as refused by its owner's limit; False if it is no longer queued."""
    stmt = (
        update(Job)
        .where(Job.id == job_id, Job.status == "queued")
        # updated_at kept as it is: nothing a client sees has changed.
        .values(quota_deferred=True, updated_at=Job.updated_at)
    )
    return bool(session.execute(stmt).rowcount)  # type: ignore[attr-defined]


def take_deferred(
    session: Session, *, max_running: int, owner_id: int | None = None, limit: int = 100
) -> list[tuple[str, str]]:
    """Clear the mark of the oldest deferred jobs whose owners are under the limit; (id, device) to publish.

    At most as many per owner as that owner has free running slots. The conditional UPDATE hands
    each job to one caller even with many workers doing this at once.
    """
    running = _running_of_owner()
    rank = func.row_number().over(partition_by=Job.owner_id, order_by=(Job.created_at, Job.id))
    candidates = select(Job.id, rank.label("n"), running.label("running")).where(
        Job.status == "queued", Job.quota_deferred.is_(True)
    )
    if owner_id is not None:
        candidates = candidates.where(Job.owner_id == owner_id)
    ranked = candidates.subquery()
    chosen = (
        select(ranked.c.id).where(ranked.c.n <= max_running - ranked.c.running).limit(limit).scalar_subquery()
    )
    stmt = (
        update(Job)
        .where(and_(Job.id.in_(chosen), Job.status == "queued", Job.quota_deferred.is_(True)))
        .values(quota_deferred=False, updated_at=Job.updated_at)
        .returning(Job.id, Job.spec)
    )
    return [(job_id, str(spec["resources"]["device"])) for job_id, spec in session.execute(stmt)]
