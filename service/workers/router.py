"""Thin routes of `/v1/workers`."""

from __future__ import annotations

from fastapi import APIRouter

from api_schemas import WorkerList
from service.deps import CurrentUser, SessionDep, SettingsDep
from service.errors import TooManyRequests, Unauthorized, error_responses
from service.strict_json import StrictJSONRoute
from service.workers import service

router = APIRouter(
    prefix="/v1/workers",
    tags=["workers"],
    responses=error_responses(Unauthorized, TooManyRequests),
    route_class=StrictJSONRoute,
)


@router.get("", response_model=WorkerList)
def list_workers(session: SessionDep, user: CurrentUser, settings: SettingsDep) -> WorkerList:
    """Every worker the service knows: devices, slots, running jobs, last heartbeat."""
    return service.list_workers(session, user=user, heartbeat_seconds=settings.worker_heartbeat_seconds)
