"""A sweep's state moves only from `running`, once, by one guarded UPDATE."""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from api_schemas import SweepState
from service.models import Sweep, User
from service.sweeps import lifecycle
from tests.api_fixtures import add_user


def test_a_decided_sweep_stays_decided(db: Session) -> None:
    add_user(db, "sweeper")
    owner = db.scalar(select(User.id).where(User.name == "sweeper"))
    assert owner is not None
    db.add(Sweep(id="sw", name="sw", owner_id=owner, state=SweepState.RUNNING.value, spec={}))
    db.flush()
    decided = lifecycle.transition(db, sweep_id="sw", src=SweepState.RUNNING, dst=SweepState.SUCCEEDED)
    assert decided is not None and decided.state == "succeeded" and decided.finished_at is not None
    # The owner's cancel, racing the driver's decision: the row is no longer running, nothing moves.
    assert lifecycle.transition(db, sweep_id="sw", src=SweepState.RUNNING, dst=SweepState.CANCELLED) is None
    row = db.get(Sweep, "sw", populate_existing=True)
    assert row is not None and row.state == "succeeded"
    with pytest.raises(ValueError, match="illegal sweep transition succeeded -> failed"):
        lifecycle.transition(db, sweep_id="sw", src=SweepState.SUCCEEDED, dst=SweepState.FAILED)
    assert all(state.is_terminal() for state in SweepState if state is not SweepState.RUNNING)
