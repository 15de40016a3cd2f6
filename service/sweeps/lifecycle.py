"""A sweep's lifecycle in one place: the only code that moves `sweeps.state` (its trials have none of
their own: a trial's status is its job's)."""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.orm import Session

from api_schemas import SweepState
from service.models import Sweep
from service.models.base import utcnow

# Which states a sweep may move to from each state: it is decided once, and a decided sweep stays so.
ALLOWED: dict[SweepState, frozenset[SweepState]] = {
    SweepState.RUNNING: frozenset({SweepState.SUCCEEDED, SweepState.FAILED, SweepState.CANCELLED}),
    SweepState.SUCCEEDED: frozenset(),
    SweepState.FAILED: frozenset(),
    SweepState.CANCELLED: frozenset(),
}


def can_transition(src: SweepState, dst: SweepState) -> bool:
    """Whether a sweep may move from `src` to `dst`."""
    return dst in ALLOWED[src]


def transition(
    session: Session, *, sweep_id: str, src: SweepState, dst: SweepState, error: str | None = None
) -> Sweep | None:
    """Move a sweep from `src` to `dst` with one conditional UPDATE; None if it was not in `src`.

    The WHERE clause on the current state makes it safe against a race (the driver deciding a sweep
    while its owner cancels it): of two callers only one sees its row updated. `error` says why a
    sweep failed when none of its trials did.
    """
    if not can_transition(src, dst):
        raise ValueError(f"illegal sweep transition {src.value} -> {dst.value}")
    values: dict[str, object] = {"state": dst.value}
    if dst.is_terminal():
        values["finished_at"] = utcnow()
    if error is not None:
        values["error"] = error
    stmt = update(Sweep).where(Sweep.id == sweep_id, Sweep.state == src.value).values(**values)
    return session.execute(stmt.returning(Sweep)).scalar_one_or_none()
