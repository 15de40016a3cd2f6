"""What the service knows of its workers now: capacity from heartbeats, load from running jobs."""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from api_schemas import Worker, WorkerList
from api_schemas.workers import CachedEnvironment
from service.models import User
from service.models import Worker as WorkerRow
from service.models.base import utcnow
from service.nodes import repository

# A worker that missed this many heartbeats in a row is shown as lost.
LOST_AFTER_BEATS = 3


def list_workers(
    session: Session, *, user: User, heartbeat_seconds: float, now: datetime | None = None
) -> WorkerList:
    """Every known worker node with its free slots; non-admins see no host or address, only their jobs."""
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
                name=w.name if user.is_admin else _public_name(w),
                hostname=w.hostname if user.is_admin else None,
                address=w.address if user.is_admin else None,
                device="cuda" if w.device == "cuda" else "cpu",
                device_count=w.device_count,
                slots=w.slots,
                free_slots=max(0, w.slots - busy.get(w.name, 0)),
                running_jobs=running.get(w.name, []),
                last_heartbeat=w.last_heartbeat,
                heartbeat_age_seconds=round(age, 3),
                status="lost" if age > LOST_AFTER_BEATS * heartbeat_seconds else "alive",
                cached_environments=_environments(w.environments),
            )
        )
    return WorkerList(items=items)


def _environments(stored: Any) -> list[CachedEnvironment]:
    try:
        return [CachedEnvironment.model_validate(e) for e in stored or []]
    except ValidationError:
        return []  # written by the worker alone: a damaged record is just not shown


def _public_name(w: WorkerRow) -> str:
    return public_name(w.name, hostname=w.hostname, address=w.address, started_at=w.started_at)


def public_name(name: str, *, hostname: str, address: str, started_at: datetime) -> str:
    """The node's name as a non-admin sees it (here and in `/metrics`): an alias where it names its host."""
    # Where the node's name gives away its host (the default name is the host name) or its address,
    # a user sees an alias instead. It is a hash of the name and the row's start, not of the name
    # alone (a host name is easy to guess, so its hash would be easy to reverse); it stays the same
    # while the node keeps beating and is new once a node that stopped cleanly comes back.
    lowered = name.lower()
    revealing = [hostname.lower(), hostname.lower().split(".")[0], address.lower()]
    if not any(part and part in lowered for part in revealing):
        return name
    digest = hashlib.sha256(f"{name}\n{started_at.isoformat()}".encode()).hexdigest()
    return f"node-{digest[:12]}"
