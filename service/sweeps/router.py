"""Thin routes of `/v1/sweeps`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query, status
from fastapi.exceptions import RequestValidationError

from api_schemas import Sweep, SweepCreate, SweepList
from service.deps import CurrentUser, SchedulerDep, SessionDep, SettingsDep, after_commit
from service.errors import Forbidden, NotFound, error_responses, invalid_field
from service.params import Text
from service.routing import v1_router
from service.sweeps import service

router = v1_router("sweeps")
SweepId = Annotated[Text, Path(max_length=32, description="The sweep's id.")]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=Sweep,
    responses=error_responses(Forbidden, NotFound),
)
def create_sweep(
    body: SweepCreate, session: SessionDep, user: CurrentUser, settings: SettingsDep, scheduler: SchedulerDep
) -> Sweep:
    """Submit a sweep; every checked point of its space must make a valid job, else 422 naming the path."""
    sweep = service.create(session, user=user, body=body, settings=settings)
    # The scheduler's round runs the sweep driver, which submits the first trials: now, not a beat later.
    after_commit(session, scheduler.kick)
    return service.present(session, sweep=sweep, owner=user.name)


@router.get("", response_model=SweepList)
def list_sweeps(
    session: SessionDep,
    user: CurrentUser,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: str | None = None,
) -> SweepList:
    """List sweeps newest first; pass `next_cursor` back as `cursor` for the next page."""
    try:
        return service.listed(session, user=user, limit=limit, cursor=cursor)
    except ValueError as exc:
        error: RequestValidationError = invalid_field(("query", "cursor"), str(exc), cursor)
        raise error from exc


@router.get("/{sweep_id}", response_model=Sweep, responses=error_responses(NotFound))
def get_sweep(sweep_id: SweepId, session: SessionDep, user: CurrentUser) -> Sweep:
    """A sweep: its state, its trials (parameters, status, objective) and the best."""
    return service.shown(session, user=user, sweep_id=sweep_id)


@router.post("/{sweep_id}/cancel", response_model=Sweep, responses=error_responses(NotFound))
def cancel_sweep(sweep_id: SweepId, session: SessionDep, user: CurrentUser) -> Sweep:
    """Cancel a sweep: it starts no more trials, and its queued and running trials are cancelled."""
    sweep = service.cancel(session, user=user, sweep_id=sweep_id)
    return service.present(session, sweep=sweep, owner=user.name)
