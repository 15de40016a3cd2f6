"""The per-user running-jobs limit: enforced in the claim's UPDATE, deferred jobs run once room frees up."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobSpec, JobStatus
from service.auth.tokens import ensure_bootstrap_admin
from service.db import session_factory
from service.jobs import lifecycle, service
from service.models import Job
from service.users import service as users
from tests.api_fixtures import ADMIN_TOKEN, RecordingDispatcher, add_user, as_user
from tests.conftest import create_database, drop_database
from tests.jobs.test_router import SPEC
from workers.reconciler import republish_deferred


def _claim(sessions: sessionmaker[Session], job_id: str, limit: int = 2) -> bool:
    with sessions.begin() as s:
        return lifecycle.claim(s, job_id=job_id, worker="w:1", max_running_per_user=limit) is not None


def _row(db: Session, job_id: str) -> Job:
    db.expire_all()
    job = db.get(Job, job_id)
    assert job is not None
    return job


def _finish(sessions: sessionmaker[Session], job_id: str) -> None:
    with sessions.begin() as s:
        assert lifecycle.transition(s, job_id=job_id, src=JobStatus.RUNNING, dst=JobStatus.SUCCEEDED)


class TestLimit:
    def test_a_claim_over_the_limit_leaves_the_job_queued_and_deferred(
        self, client: TestClient, db: Session, sessions: sessionmaker[Session]
    ) -> None:
        kim = as_user(add_user(db, "kim"))
        ids = [client.post("/v1/jobs", json=SPEC, headers=kim).json()["id"] for _ in range(3)]
        assert [_claim(sessions, i) for i in ids] == [True, True, False], "the third exceeds the limit of 2"
        third = _row(db, ids[2])
        assert (third.status, third.quota_deferred) == ("queued", True), (
            f"expected queued and deferred, got {third.status}, {third.quota_deferred}"
        )
        leo = as_user(add_user(db, "leo"))
        other = client.post("/v1/jobs", json=SPEC, headers=leo).json()["id"]
        assert _claim(sessions, other), "another user's job is not held back by kim's limit"

    def test_when_a_job_ends_the_oldest_deferred_one_is_published_and_then_runs(
        self, client: TestClient, db: Session, sessions: sessionmaker[Session]
    ) -> None:
        ids = [client.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(4)]
        assert [_claim(sessions, i) for i in ids] == [True, True, False, False]
        owner = _row(db, ids[0]).owner_id
        sent = RecordingDispatcher()
        assert republish_deferred(sessions=sessions, dispatcher=sent, max_running=2, owner_id=owner) == [], (
            "nothing is published while the owner is still at the limit"
        )
        _finish(sessions, ids[0])
        assert republish_deferred(sessions=sessions, dispatcher=sent, max_running=2, owner_id=owner) == [
            ids[2]
        ], "one slot free: exactly the oldest deferred job is published"
        assert not _row(db, ids[2]).quota_deferred and _row(db, ids[3]).quota_deferred
        assert _claim(sessions, ids[2]), "the published job is claimed"
        assert not _claim(sessions, ids[3]), "the limit still holds for the last one"

    def test_the_reconciler_round_covers_every_owner(
        self, client: TestClient, db: Session, sessions: sessionmaker[Session]
    ) -> None:
        ids = [client.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(2)]
        assert [_claim(sessions, i, limit=1) for i in ids] == [True, False]
        _finish(sessions, ids[0])
        sent = RecordingDispatcher()
        # No owner given: a reconciler round after a worker died before it could publish.
        assert republish_deferred(sessions=sessions, dispatcher=sent, max_running=1) == [ids[1]]
        assert sent.devices == ["cpu"], sent.devices

    def test_a_cancelled_job_is_not_deferred(
        self, client: TestClient, db: Session, sessions: sessionmaker[Session]
    ) -> None:
        job = client.post("/v1/jobs", json=SPEC).json()["id"]
        client.post(f"/v1/jobs/{job}/cancel")
        assert not _claim(sessions, job)
        assert not _row(db, job).quota_deferred, "only a queued job waits for room"


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sessionmaker[Session]]:
    """A database of its own: concurrent claims need real commits on separate connections."""
    url = create_database("dptrain_quota")
    from service.config import Settings

    yield session_factory(Settings(database_url=url, home=tmp_path_factory.mktemp("quota")))
    drop_database(url)


def test_concurrent_claims_never_pass_the_limit_together(committed: sessionmaker[Session]) -> None:
    with committed.begin() as s:
        ensure_bootstrap_admin(s, token=ADMIN_TOKEN)
        users.create(s, name="racer", admin=False)
    spec = JobSpec.model_validate(SPEC)
    for round_ in range(5):
        with committed.begin() as s:
            racer = users.repository.by_name(s, name="racer")
            assert racer is not None
            ids = [service.submit(s, user=racer, spec=spec).id for _ in range(4)]
        barrier = threading.Barrier(len(ids))
        won: list[str] = []

        def claim(job_id: str, barrier: threading.Barrier, won: list[str]) -> None:
            barrier.wait(timeout=30)
            if _claim(committed, job_id, limit=1):
                won.append(job_id)

        threads = [threading.Thread(target=claim, args=(i, barrier, won)) for i in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(won) == 1, f"round {round_}: limit 1, expected exactly one claim to win, got {won}"
        _finish(committed, won[0])
        with committed.begin() as s:
            s.query(Job).filter(Job.id.in_(ids), Job.status == "queued").update({"status": "cancelled"})
