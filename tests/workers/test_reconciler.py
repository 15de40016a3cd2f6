"""A queued job whose publish was lost is published again, once per period, and nothing else is."""

from __future__ import annotations

from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service.models import Job
from service.models.base import utcnow
from tests.api_fixtures import RecordingDispatcher
from workers.reconciler import republish_stale

SPEC = {"name": "r", "recipe": "mlp", "hyperparameters": {"global_batch_size": 4, "steps": 1}}


def test_only_stale_queued_jobs_are_republished_once_per_period(
    client: TestClient, sessions: sessionmaker[Session], db: Session
) -> None:
    stale, fresh, running = (client.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(3))
    old = utcnow() - timedelta(minutes=20)
    db.query(Job).filter(Job.id.in_([stale, running])).update({"updated_at": old})
    db.query(Job).filter_by(id=running).update({"status": "running"})
    db.commit()

    again = RecordingDispatcher()
    assert republish_stale(sessions=sessions, dispatcher=again, after_seconds=600) == [stale]
    assert again.devices == ["cpu"]
    assert republish_stale(sessions=sessions, dispatcher=again, after_seconds=600) == [], (
        "a job just republished waits a full period before the next try"
    )
    assert fresh not in again.sent and running not in again.sent
