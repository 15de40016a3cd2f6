"""Every SQL query of placement: live nodes under row locks, queued jobs in order, job_nodes rows."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NamedTuple, cast

from pydantic import ValidationError
from sqlalchemy import (
    Select,
    Table,
    bindparam,
    delete,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from api_schemas import JobStatus, Resources
from service.db import is_postgresql
from service.jobs.stored import describe
from service.models import Job, JobNode, Worker


class QueuedNeeds(NamedTuple):
    """What a queued job asks for, as placement reads it from its spec's `resources`."""

    device: str
    nodes: int
    processes_per_node: int


def lock_live_nodes(session: Session, *, beat_after: datetime) -> Sequence[Worker]:
    """The nodes that beat after `beat_after`, locked until this transaction ends.

    Every placement takes these locks first (in name order, so two placements never deadlock), so
    placements run one after another and never hand out the same free slots twice. Ending an
    attempt only deletes job_nodes rows (frees slots) and needs no lock. SQLite has no row locks:
    a write first takes its one database write lock for the whole transaction instead.
    """
    stmt = _live(beat_after)
    if is_postgresql(session):
        return session.execute(stmt.with_for_update()).scalars().all()
    session.execute(update(Worker).where(Worker.name == "").values(slots=Worker.slots))
    return session.execute(stmt).scalars().all()


def live_nodes(session: Session, *, beat_after: datetime, device: str) -> Sequence[Worker]:
    """The nodes of `device` that beat after `beat_after`, unlocked: what a submit checks its job against."""
    # No lock: a submit only reads capacity, and must not queue behind placement rounds.
    return session.execute(_live(beat_after).where(Worker.device == device)).scalars().all()


def _live(beat_after: datetime) -> Select[Worker]:
    return select(Worker).where(Worker.last_heartbeat > beat_after).order_by(Worker.name)


def used_slots(session: Session) -> dict[str, int]:
    """Slots held by running jobs, per node."""
    stmt = select(JobNode.worker, func.sum(JobNode.slots)).group_by(JobNode.worker)
    return {w: int(n or 0) for w, n in session.execute(stmt)}


def ports_in_use(session: Session) -> set[int]:
    """Rendezvous ports held by running multi-node jobs."""
    ports = session.execute(select(JobNode.port).where(JobNode.port.is_not(None))).scalars()
    return {int(p) for p in ports if p is not None}


def rank_uids_in_use(session: Session) -> set[int]:
    """The uids running multi-node attempts' ranks hold (on any of their nodes, until each ends)."""
    uids = session.execute(select(JobNode.rank_uid).where(JobNode.rank_uid.is_not(None)).distinct()).scalars()
    return {int(u) for u in uids if u is not None}


class Queued(NamedTuple):
    """A queued job placement can read, and what it needs."""

    job_id: str
    owner_id: int
    needs: QueuedNeeds
    queued_reason: str | None


class Unreadable(NamedTuple):
    """A queued job whose stored spec placement cannot read, and why."""

    job_id: str
    problem: str


def needs_of(spec_kind: str | None, resources: str | None) -> QueuedNeeds | str:
    """What a queued job asks for, from its spec's JSON type and `resources` text; else what is wrong."""
    if spec_kind != "object":
        return f"the stored spec is not a JSON object: {spec_kind}"
    return _needs(resources)


@lru_cache(maxsize=256)
def _needs(resources: str | None) -> QueuedNeeds | str:
    """What a spec's `resources` (JSON text, None when absent) asks for, or why it cannot be read."""
    # Cached: the queued jobs of a round share a handful of shapes, each parsed and validated once.
    try:
        found = Resources() if resources is None else Resources.model_validate_json(resources)
    except ValidationError as exc:
        return f"the stored spec's resources do not validate: {describe(exc)}"
    return QueuedNeeds(found.device, found.nodes, found.processes_per_node)


def running_per_owner(session: Session) -> dict[int, int]:
    """How many jobs each owner has running."""
    stmt = (
        select(Job.owner_id, func.count()).where(Job.status == JobStatus.RUNNING.value).group_by(Job.owner_id)
    )
    return {int(o): int(n) for o, n in session.execute(stmt)}


class Wait(NamedTuple):
    """Why a queued job waits, and whether no set of live nodes could ever hold it."""

    reason: str
    unplaceable: bool = False


def set_reasons(session: Session, *, waits: dict[str, Wait]) -> None:
    """Record why queued jobs wait, each only if it changed (a change bumps updated_at: clients see it)."""
    if not waits:
        return
    # One executemany (psycopg pipelines it) instead of a statement and a round trip per job: a
    # stream of submits gives every round a batch of new jobs to explain.
    jobs = cast(Table, Job.__table__)
    stmt = (
        update(jobs)
        .where(
            jobs.c.id == bindparam("job_id"),
            jobs.c.status == JobStatus.QUEUED.value,
            or_(
                jobs.c.queued_reason.is_distinct_from(bindparam("reason")),
                jobs.c.unplaceable.is_distinct_from(bindparam("unplaceable")),
            ),
        )
        # and updated_at, by the column's onupdate: the ETag, the poll cache's NOTIFY and the event
        # stream all follow it.
        .values(queued_reason=bindparam("reason"), unplaceable=bindparam("unplaceable"))
    )
    rows = [{"job_id": j, "reason": w.reason, "unplaceable": w.unplaceable} for j, w in waits.items()]
    session.connection().execute(stmt, rows)


def add_nodes(session: Session, *, rows: list[dict[str, Any]]) -> None:
    """Insert the job_nodes rows of one placement."""
    session.execute(insert(JobNode), rows)


def release_job(session: Session, *, job_id: str) -> None:
    """Free every node of a job (its attempt ended)."""
    session.execute(delete(JobNode).where(JobNode.job_id == job_id))


def release_node(session: Session, *, job_id: str, attempt: int, worker: str) -> None:
    """Free one node of an attempt whose ranks there have exited (the others may still run)."""
    session.execute(
        delete(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == attempt, JobNode.worker == worker)
    )


def nodes_of(session: Session, *, job_id: str) -> Sequence[JobNode]:
    """A running job's nodes in node-rank order."""
    return (
        session.execute(select(JobNode).where(JobNode.job_id == job_id).order_by(JobNode.node_rank))
        .scalars()
        .all()
    )


def accept(
    session: Session, *, job_id: str, attempt: int, node_rank: int, worker: str, now: datetime
) -> bool:
    """Mark a placed node started by its worker; False for a stale or duplicate message (nothing runs)."""
    stmt = (
        update(JobNode)
        .where(
            JobNode.job_id == job_id,
            JobNode.node_rank == node_rank,
            JobNode.attempt == attempt,
            JobNode.worker == worker,
            JobNode.started_at.is_(None),
        )
        .values(started_at=now)
    )
    return (session.execute(stmt).rowcount or 0) > 0  # type: ignore[attr-defined]


def unstarted(session: Session, *, placed_before: datetime, now: datetime) -> list[tuple[str, int, int, str]]:
    """Take placed nodes not started since `placed_before`: bump placed_at; (job, attempt, rank, worker).

    The conditional UPDATE hands each to one reconciler per period even with many workers.
    """
    stmt = (
        update(JobNode)
        .where(JobNode.started_at.is_(None), JobNode.placed_at < placed_before)
        .values(placed_at=now)
        .returning(JobNode.job_id, JobNode.attempt, JobNode.node_rank, JobNode.worker)
    )
    return [(j, int(a), int(r), str(w)) for j, a, r, w in session.execute(stmt)]


def endpoint(session: Session, *, job_id: str) -> str:
    """The rendezvous endpoint of a running job ("address:port" of node 0), "" for a single-node job."""
    stmt = select(JobNode.address, JobNode.port).where(JobNode.job_id == job_id, JobNode.node_rank == 0)
    row = session.execute(stmt).first()
    return f"{row[0]}:{row[1]}" if row is not None and row[1] is not None else ""


def leases(
    session: Session,
) -> Sequence[tuple[str, str, int, int, str, datetime, datetime | None, datetime | None]]:
    """(job id, claim token, attempt, max_restarts, worker, placed_at, started_at, the worker's last
    heartbeat or None when its row is gone) of every node of every running job: what the reconciler checks."""
    stmt = (
        select(
            Job.id,
            Job.claim_token,
            Job.attempt,
            Job.max_restarts,
            JobNode.worker,
            JobNode.placed_at,
            JobNode.started_at,
            Worker.last_heartbeat,
        )
        .join(JobNode, JobNode.job_id == Job.id)
        .outerjoin(Worker, Worker.name == JobNode.worker)
        .where(
            Job.status == JobStatus.RUNNING.value,
            Job.claim_token.is_not(None),
            JobNode.attempt == Job.attempt,
        )
        .order_by(Job.id, JobNode.node_rank)
    )
    return [
        (j, str(t), int(a), int(m), str(w), placed, started, beat)
        for j, t, a, m, w, placed, started, beat in session.execute(stmt)
    ]
