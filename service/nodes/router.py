"""Thin routes of `/v1/workers`."""

from __future__ import annotations

from api_schemas import WorkerList
from service.deps import CurrentUser, SessionDep, SettingsDep
from service.nodes import service
from service.routing import v1_router

router = v1_router("workers")


@router.get("", response_model=WorkerList)
def list_workers(session: SessionDep, user: CurrentUser, settings: SettingsDep) -> WorkerList:
    """Every worker the service knows: devices, slots, running jobs, last heartbeat."""
    return service.list_workers(session, user=user, heartbeat_seconds=settings.worker_heartbeat_seconds)
