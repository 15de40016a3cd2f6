"""SQL for stack dumps: a user's request for one, and the dumps the workers store."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from service.db import insert_for
from service.models import RankStacks, StackRequest


def request(session: Session, *, job_id: str, now: datetime) -> None:
    """Ask the job's workers for a fresh dump (a later request replaces an earlier one)."""
    stmt = insert_for(session, StackRequest).values(job_id=job_id, requested_at=now)
    stmt = stmt.on_conflict_do_update(index_elements=[StackRequest.job_id], set_={"requested_at": now})
    session.execute(stmt)


def requested_at(session: Session, *, job_id: str) -> datetime | None:
    """When the job's stacks were last asked for, None if never."""
    stmt = select(StackRequest.requested_at).where(StackRequest.job_id == job_id)
    return session.execute(stmt).scalar_one_or_none()


def add_dump(session: Session, *, row: dict[str, Any]) -> None:
    """Store one node's dump; a requested dump replaces that node's earlier requested ones."""
    if row["requested_at"] is not None:
        session.execute(
            delete(RankStacks).where(
                RankStacks.job_id == row["job_id"],
                RankStacks.node == row["node"],
                RankStacks.requested_at.is_not(None),
            )
        )
    session.add(RankStacks(**row))


def latest(session: Session, *, job_id: str) -> Sequence[RankStacks]:
    """The latest dump of each node of the job's latest dumped attempt, by node."""
    last = select(func.max(RankStacks.id)).where(RankStacks.job_id == job_id).group_by(RankStacks.node)
    rows = session.execute(select(RankStacks).where(RankStacks.id.in_(last))).scalars().all()
    attempt = max((r.attempt for r in rows), default=0)
    return sorted((r for r in rows if r.attempt == attempt), key=lambda r: r.node)
