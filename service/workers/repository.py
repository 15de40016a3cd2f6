"""Every SQL query of the workers domain."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.orm import Session

from service.models import Job, Worker


def heartbeat(
    session: Session,
    *,
    name: str,
    hostname: str,
    device: str,
    device_count: int,
    slots: int,
    now: datetime,
) -> None:
    """Record that worker `name` is alive now (its row is created on the first beat)."""
    values = {"hostname": hostname, "device": device, "device_count": device_count, "slots": slots}
    stmt = update(Worker).where(Worker.name == name).values(**values, last_heartbeat=now)
    # Only this worker process writes its own row, so update-then-insert cannot race with itself.
    if not (session.execute(stmt).rowcount or 0):  # type: ignore[attr-defined]
        session.execute(insert(Worker).values(name=name, **values, started_at=now, last_heartbeat=now))


def remove(session: Session, *, name: str) -> None:
    """Forget a worker that stopped cleanly (a crashed one stays, shown as lost)."""
    session.execute(delete(Worker).where(Worker.name == name))


def all_workers(session: Session) -> Sequence[Worker]:
    """Every known worker by name."""
    return session.execute(select(Worker).order_by(Worker.name)).scalars().all()


def running_jobs(session: Session) -> Sequence[tuple[str, str, int]]:
    """(worker, job id, owner id) of every running job."""
    stmt = (
        select(Job.worker, Job.id, Job.owner_id)
        .where(Job.status == "running", Job.worker.is_not(None))
        .order_by(Job.created_at)
    )
    return [(str(w), j, o) for w, j, o in session.execute(stmt)]


def leased_jobs(
    session: Session,
) -> Sequence[tuple[str, str, str, int, int, dict[str, Any], datetime | None, datetime | None]]:
    """(job id, worker, claim token, attempt, max_restarts, spec, started_at, worker's last heartbeat or
    None when its row is gone) of every running job: the attempt leases the reconciler checks."""
    stmt = (
        select(
            Job.id,
            Job.worker,
            Job.claim_token,
            Job.attempt,
            Job.max_restarts,
            Job.spec,
            Job.started_at,
            Worker.last_heartbeat,
        )
        .outerjoin(Worker, Worker.name == Job.worker)
        .where(Job.status == "running", Job.claim_token.is_not(None))
    )
    return [
        (j, str(w), str(t), int(a), int(m), dict(s), started, beat)
        for j, w, t, a, m, s, started, beat in session.execute(stmt)
    ]
