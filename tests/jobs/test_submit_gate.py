"""The submit gate: a job's submit, a sweep's and a sweep's trial refuse the same spec for the same reason."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import SweepCreate
from service.config import Settings
from service.models import Job, Sweep, User
from service.models.base import utcnow
from service.sweeps import driver
from service.sweeps import repository as sweeps_repository
from tests.api_fixtures import SPEC, add_user, as_user
from tests.conftest import job_spec

ALLOWED = "allowed."


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The API's settings with an entrypoint allow-list, so that an entrypoint outside it is refused."""
    return settings.model_copy(update={"allowed_entrypoints": ALLOWED})


@dataclass(frozen=True)
class Refused:
    spec: dict[str, Any]
    status: int
    says: str  # part of the reason, whichever caller gives it
    as_admin: bool = False


CASES = {
    "an entrypoint outside the allow-list": Refused(
        spec={"name": "e", "entrypoint": "evil.plans:build"},
        status=422,
        says=f"module is not under an allowed prefix (DPTRAIN_ALLOWED_ENTRYPOINTS: {ALLOWED})",
        as_admin=True,
    ),
    "a priority above the owner's ceiling": Refused(
        spec=job_spec(SPEC, priority=5),
        status=403,
        says="priority 5 is above the highest priority user plain may submit, 0",
    ),
    "an env without the code grant": Refused(
        spec=job_spec(SPEC, env={"WANDB_MODE": "offline"}),
        status=403,
        says="user plain may not set `env`",
    ),
    # Before the gate, a sweep's submit left this check to its first trial (its answer was 201).
    "an init_from source the owner cannot see": Refused(
        spec=job_spec(SPEC, init_from={"job": "f" * 32}),
        status=404,
        says=f"init_from.job: job {'f' * 32!r} not found",
    ),
}


def _sweep(base: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "gate",
        "base": base,
        "space": {"hyperparameters.steps": {"choice": [4, 8]}},
        "objective": {"metric": "train/loss", "direction": "minimize"},
        "max_trials": 2,
        "max_concurrent_trials": 2,
    }


def _reason(r: Response) -> str:
    body = r.json()
    # A 422 lists the refused fields; every other refusal is {"error": ..., "detail": "..."}.
    return str(body["detail"][0]["msg"] if r.status_code == 422 else body["detail"])


def _recorded(db: Session, *, owner: User, base: dict[str, Any]) -> str:
    """A running sweep of `owner` recorded before the server's rule or the owner's grant changed."""
    body = SweepCreate.model_validate(_sweep(base))
    row = Sweep(
        id=uuid.uuid4().hex,
        name=body.name,
        owner_id=owner.id,
        state="running",
        spec=body.model_dump(mode="json"),
        created_at=utcnow(),
    )
    sweeps_repository.add(db, sweep=row)
    db.commit()
    return row.id


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_job_a_sweep_and_a_trial_refuse_it_for_the_same_reason(
    case: Refused, client: TestClient, sessions: sessionmaker[Session], settings: Settings, db: Session
) -> None:
    headers = {} if case.as_admin else as_user(add_user(db, "plain"))
    name = "admin" if case.as_admin else "plain"
    owner = db.scalar(select(User).where(User.name == name))
    assert owner is not None

    job = client.post("/v1/jobs", json=case.spec, headers=headers)
    assert job.status_code == case.status, job.text
    reason = _reason(job)
    assert case.says in reason, f"POST /v1/jobs said {reason!r}"

    sweep = client.post("/v1/sweeps", json=_sweep(case.spec), headers=headers)
    assert sweep.status_code == case.status, sweep.text
    assert _reason(sweep) == reason, "POST /v1/sweeps refused it for another reason"

    # A trial is gated as its own submit: the sweep fails saying why, and no job is left behind.
    sweep_id = _recorded(db, owner=owner, base=case.spec)
    driver.run_once(sessions=sessions, settings=settings)
    shown = client.get(f"/v1/sweeps/{sweep_id}", headers=headers).json()
    assert shown["state"] == "failed" and shown["trials"] == [], shown
    assert shown["error"] == f"trial 0's submit was refused ({case.status}): {reason}"
    assert db.scalar(select(func.count()).select_from(Job)) == 0
