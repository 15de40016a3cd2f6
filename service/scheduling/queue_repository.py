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
from service.models import Job

QUEUED = Job.status == JobStatus.QUEUED.value


def spec_parts(session: Session) -> tuple[ColumnElement[str | None], ColumnElement[str | None]]:
    """SQL for a stored spec's JSON type ("object" when readable) and its `resources` as JSON text."""
    # Only the spec's `resources`, extracted by the database as JSON text: this is read for every
    # queued job, and the API process must not decode whole specs (most of whose bytes it never uses).
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


def queued_count(session: Session, *, owner_id: int, up_to: int) -> int:
    """How many jobs `owner_id` has queued, counting no further than `up_to` (so the cost is bounded)."""
    mine = select(Job.id).where(Job.owner_id == owner_id, QUEUED).limit(up_to).subquery()
    return int(session.execute(select(func.count()).select_from(mine)).scalar_one())


def position_of_job() -> ColumnElement[int | None]:
    """SQL for the 1-based queue position of the `Job` row a query selects; NULL unless it is queued.

    Among the queued jobs of its device kind that are not unplaceable, in placement order: higher
    `priority` first, then `fair_key`, then oldest. Each count reads the index entries ahead of its
    job (`ix_jobs_queue`); a column of the query that reads the job, so it costs no round trip.
    """
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
    return case((and_(QUEUED, ~Job.unplaceable), count + 1))


def positions(session: Session, *, job_ids: list[str]) -> dict[str, int]:
    """The queue position of each of `job_ids` that has one (`position_of_job`), in one statement."""
    if not job_ids:
        return {}
    stmt = select(Job.id, position_of_job()).where(Job.id.in_(job_ids), QUEUED, ~Job.unplaceable)
    return {job_id: int(n) for job_id, n in session.execute(stmt) if n is not None}


class Head(NamedTuple):
    """A queued job placement looks at this round, with its stored spec's parts as the database read them."""

    job_id: str
    owner_id: int
    spec_kind: str | None
    resources: str | None
    queued_reason: str | None


def heads(session: Session, *, per_owner: int, at_limit: set[int]) -> list[Head]:
    """Each owner's first queued jobs of each device kind, in placement order; unplaceable ones left out.

    `per_owner` of them per (owner, device kind), one for an owner in `at_limit` (those already at
    their running limit: its reason is kept current; the rest of its queue could not start this
    round anyway).
    """
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
    room = case((ranked.c.owner_id.in_(at_limit), 1), else_=per_owner) if at_limit else per_owner
    chosen = select(ranked.c.id).where(ranked.c.rn <= room).subquery()
    # The spec's parts only for the chosen rows: the window above reads the index columns alone.
    kind, resources = spec_parts(session)
    stmt = (
        select(Job.id, Job.owner_id, kind, resources, Job.queued_reason)
        .join(chosen, chosen.c.id == Job.id)
        .order_by(*order)
    )
    return [Head(j, int(o), k, r, reason) for j, o, k, r, reason in session.execute(stmt)]


class Flagged(NamedTuple):
    """The unplaceable queued jobs of one `resources` (JSON text) and one reason."""

    spec_kind: str | None
    resources: str | None
    queued_reason: str | None


def unplaceable_groups(session: Session) -> list[Flagged]:
    """The queued jobs flagged unplaceable, grouped by what they ask for: each round judges them again."""
    kind, resources = spec_parts(session)
    stmt = (
        select(kind, resources, Job.queued_reason)
        .where(QUEUED, Job.unplaceable)
        .group_by(kind, resources, Job.queued_reason)
    )
    return [Flagged(k, r, reason) for k, r, reason in session.execute(stmt)]


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
