"""Every SQL query of the queue itself: fair keys, positions, the queued-jobs cap, each owner's heads."""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import (
    ColumnElement,
    and_,
    case,
    func,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.orm import Session, aliased

from api_schemas import JobStatus
from service.db import is_postgresql
from service.models import Job, User

QUEUED = Job.status == JobStatus.QUEUED.value


def spec_parts(session: Session) -> tuple[ColumnElement[str | None], ColumnElement[str | None]]:
    """SQL for a stored spec's JSON type ("object" when readable) and its `resources` as JSON text."""
    # Only the spec's `resources`, extracted by the database as JSON text: decoding every queued job's
    # whole spec was half of an API process's CPU under a stream of submits (bench/findings.md, section 4).
    resources: ColumnElement[str | None] = Job.spec["resources"].as_string()
    if is_postgresql(session):
        return func.jsonb_typeof(Job.spec), resources
    # SQLite's JSON functions fail the whole query on one row whose text they cannot parse (an
    # older version stored NaN and Infinity there): json_valid() first (a CASE is lazy).
    kind = case((func.json_valid(Job.spec) == 1, func.json_type(Job.spec)), else_="invalid JSON")
    return kind, case((kind == "object", resources))


def fair_key(session: Session, *, owner_id: int, device: str, priority: int) -> int:
    """The fair key of a job `owner_id` submits now: after its own queued jobs, never before the head."""
    same = (QUEUED, Job.device == device, Job.priority == priority)
    head = select(func.min(Job.fair_key)).where(*same, ~Job.unplaceable).scalar_subquery()
    last = select(func.max(Job.fair_key)).where(*same, Job.owner_id == owner_id).scalar_subquery()
    head_key, last_key = session.execute(select(head, last)).one()
    return max(int(head_key or 0), int(last_key) + 1 if last_key is not None else 0)


def lock_owner(session: Session, *, owner_id: int) -> None:
    """Lock the owner's row until this transaction ends: submits of one owner count their queue in turn."""
    # FOR NO KEY UPDATE, not FOR UPDATE: the job just inserted holds FOR KEY SHARE on this row (its
    # foreign key), which FOR UPDATE would wait on in every other submit of the owner: a deadlock.
    # SQLite has no row locks, and needs none: the insert already took its one database write lock.
    if is_postgresql(session):
        session.execute(select(User.id).where(User.id == owner_id).with_for_update(key_share=True))


def queued_count(session: Session, *, owner_id: int, up_to: int) -> int:
    """How many jobs `owner_id` has queued, counting no further than `up_to` (so the cost is bounded)."""
    mine = select(Job.id).where(Job.owner_id == owner_id, QUEUED).limit(up_to).subquery()
    return int(session.execute(select(func.count()).select_from(mine)).scalar_one())


def positions(session: Session, *, job_ids: list[str]) -> dict[str, int]:
    """The 1-based queue position of each of `job_ids` that is queued and not unplaceable.

    Among the queued jobs of its device kind that are not unplaceable, in placement order: higher
    `priority` first, then `fair_key`, then oldest. One statement; each count reads the index
    entries ahead of its job (`ix_jobs_queue`).
    """
    if not job_ids:
        return {}
    ahead = aliased(Job)
    count = (
        select(func.count())
        .where(
            ahead.status == JobStatus.QUEUED.value,
            ~ahead.unplaceable,
            ahead.device == Job.device,
            or_(
                ahead.priority > Job.priority,
                and_(
                    ahead.priority == Job.priority,
                    tuple_(ahead.fair_key, ahead.created_at, ahead.id)
                    < tuple_(Job.fair_key, Job.created_at, Job.id),
                ),
            ),
        )
        .correlate(Job)
        .scalar_subquery()
    )
    stmt = select(Job.id, count).where(Job.id.in_(job_ids), QUEUED, ~Job.unplaceable)
    return {job_id: int(n) + 1 for job_id, n in session.execute(stmt)}


class Head(NamedTuple):
    """A queued job placement looks at this round, with its stored spec's parts as the database read them."""

    job_id: str
    owner_id: int
    spec_kind: str | None
    resources: str | None
    queued_reason: str | None
    unplaceable: bool


def heads(session: Session, *, per_owner: int, max_running: int) -> list[Head]:
    """Each owner's first queued jobs of each device kind, in placement order; unplaceable ones left out.

    `per_owner` of them per (owner, device kind), one for an owner already at `max_running` (its
    reason is kept current; the rest of its queue could not start this round anyway).
    """
    running = (
        select(Job.owner_id, func.count().label("n"))
        .where(Job.status == JobStatus.RUNNING.value)
        .group_by(Job.owner_id)
        .subquery()
    )
    order = (Job.priority.desc(), Job.fair_key, Job.created_at, Job.id)
    ranked = (
        select(
            Job.id,
            Job.owner_id,
            func.row_number().over(partition_by=(Job.owner_id, Job.device), order_by=order).label("rn"),
        )
        .where(QUEUED, ~Job.unplaceable)
        .subquery()
    )
    room = case((func.coalesce(running.c.n, 0) >= max_running, 1), else_=per_owner)
    chosen = (
        select(ranked.c.id)
        .outerjoin(running, running.c.owner_id == ranked.c.owner_id)
        .where(ranked.c.rn <= room)
        .subquery()
    )
    # The spec's parts only for the chosen rows: the window above reads the index columns alone.
    kind, resources = spec_parts(session)
    stmt = (
        select(Job.id, Job.owner_id, kind, resources, Job.queued_reason, Job.unplaceable)
        .join(chosen, chosen.c.id == Job.id)
        .order_by(*order)
    )
    return [Head(j, int(o), k, r, reason, bool(u)) for j, o, k, r, reason, u in session.execute(stmt)]


class Flagged(NamedTuple):
    """The unplaceable queued jobs of one `resources` (JSON text) and one reason."""

    spec_kind: str | None
    resources: str | None
    queued_reason: str | None
    jobs: int


def unplaceable_groups(session: Session) -> list[Flagged]:
    """The queued jobs flagged unplaceable, grouped by what they ask for: each round judges them again."""
    kind, resources = spec_parts(session)
    stmt = (
        select(kind, resources, Job.queued_reason, func.count())
        .where(QUEUED, Job.unplaceable)
        .group_by(kind, resources, Job.queued_reason)
    )
    return [Flagged(k, r, reason, int(n)) for k, r, reason, n in session.execute(stmt)]


def set_group(session: Session, *, group: Flagged, reason: str | None, unplaceable: bool) -> None:
    """Give every unplaceable queued job of `group` a new reason and flag."""
    _, resources = spec_parts(session)
    # and updated_at, by the column's onupdate: ETags, the poll cache's NOTIFY and the event stream see it.
    session.execute(
        update(Job)
        .where(
            QUEUED,
            Job.unplaceable,
            resources.is_not_distinct_from(group.resources),
            Job.queued_reason.is_not_distinct_from(group.queued_reason),
        )
        .values(queued_reason=reason, unplaceable=unplaceable)
        .execution_options(synchronize_session=False)
    )
