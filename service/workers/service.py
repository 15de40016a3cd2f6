"""What the service knows of its workers now: capacity from heartbeats, load from running jobs."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from api_schemas import Worker, WorkerList
from service.models import User
from service.models.base import utcnow
from service.workers import repository

# A worker that missed this many heartbeats in a row is shown as lost.
LOST_AFTER_BEATS = 3


def list_workers(
    session: Session, *, user: User, heartbeat_seconds: float, now: datetime | None = None
) -> WorkerList:
    """Every known worker node with its free slots; non-admins see only their own jobs' ids."""
    now = now or utcnow()
    running: dict[str, list[str]] = {}
    busy: dict[str, int] = {}
    for worker, job_id, owner_id, slots in repository.placements(session):
        busy[worker] = busy.get(worker, 0) + slots
        if user.is_admin or owner_id == user.id:
            running.setdefault(worker, []).append(job_id)
    items = []
    for w in repository.all_workers(session):
        age = max(0.0, (now - w.last_heartbeat).total_seconds())
        items.append(
            Worker(
                name=w.name,
                hostname=w.hostname,
                address=w.address,
                device="cuda" if w.device == "cuda" else "cpu",
                device_count=w.device_count,
                slots=w.slots,
                free_slots=max(0, w.slots - busy.get(w.name, 0)),
                running_jobs=running.get(w.name, []),
                last_heartbeat=w.last_heartbeat,
                heartbeat_age_seconds=round(age, 3),
                status="lost" if age > LOST_AFTER_BEATS * heartbeat_seconds else "alive",
            )
        )
    return WorkerList(items=items)
