"""Every SQL query of the node registry (the `workers` table and its heartbeats)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.orm import Session

from service.models import Job, JobNode, Worker


def heartbeat(
    session: Session,
    *,
    name: str,
    hostname: str,
    address: str,
    device: str,
    device_count: int,
    slots: int,
    now: datetime,
    environments: list[dict[str, Any]] | None = None,
) -> None:
    """Record that worker `name` is alive now (its row is created on the first beat)."""
    values: dict[str, Any] = {
        "environments": environments,
        "hostname": hostname,
        "address": address,
        "device": device,
        "device_count": device_count,
        "slots": slots,
    }
    stmt = update(Worker).where(Worker.name == name).values(**values, last_heartbeat=now)
    # Only this worker node writes its own row, so update-then-insert cannot race with itself.
    if not (session.execute(stmt).rowcount or 0):  # type: ignore[attr-defined]
        session.execute(insert(Worker).values(name=name, **values, started_at=now, last_heartbeat=now))


def remove(session: Session, *, name: str) -> None:
    """Forget a worker that stopped cleanly (a crashed one stays, shown as lost)."""
    session.execute(delete(Worker).where(Worker.name == name))


def all_workers(session: Session) -> Sequence[Worker]:
    """Every known worker by name."""
    return session.execute(select(Worker).order_by(Worker.name)).scalars().all()


def placements(session: Session) -> Sequence[tuple[str, str, int, int]]:
    """(worker, job id, owner id, slots) of every node of every running job."""
    stmt = (
        select(JobNode.worker, JobNode.job_id, Job.owner_id, JobNode.slots)
        .join(Job, Job.id == JobNode.job_id)
        .order_by(Job.created_at, JobNode.node_rank)
    )
    return [(str(w), j, int(o), int(n)) for w, j, o, n in session.execute(stmt)]
