"""The reconciler: lost workers' jobs restarted or failed (every node's lease counts), old history purged."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError
from service.config import Settings
from service.models import Checkpoint, Job, JobNode, JobTransition, LogLine, Metric, Worker
from service.models.base import utcnow
from tests.conftest import job_spec
from workers.node.reconciler import purge_expired, recover_lost
from workers.reporting.reporter import Reporter

SPEC = job_spec(name="r", hyperparameters={"global_batch_size": 4, "steps": 1})


def _node(db: Session, job_id: str, *, rank: int, worker: str) -> None:
    """A started node of attempt 1 of a job on `worker`."""
    at = utcnow() - timedelta(minutes=5)
    db.add(
        JobNode(
            job_id=job_id,
            node_rank=rank,
            attempt=1,
            worker=worker,
            slots=1,
            address="10.0.0.1",
            placed_at=at,
            started_at=at,
        )
    )


class TestLostWorkers:
    """A running job whose worker stopped beating is taken from it, fenced, and restarted or failed."""

    def _running(self, db: Session, job_id: str, *, worker: str, max_restarts: int, also: str = "") -> str:
        """Make a job run attempt 1 on `worker` (and on `also` as node 1), as placement would."""
        token = uuid.uuid4().hex
        for rank, node in enumerate(n for n in (worker, also) if n):
            _node(db, job_id, rank=rank, worker=node)
        db.query(Job).filter_by(id=job_id).update(
            {
                "status": "running",
                "attempt": 1,
                "claim_token": token,
                "worker": worker,
                "max_restarts": max_restarts,
                "started_at": utcnow() - timedelta(minutes=5),
            }
        )
        return token

    def _beat(self, db: Session, name: str, *, age: timedelta) -> None:
        at = utcnow() - age
        db.add(
            Worker(
                name=name,
                hostname="h",
                device="cpu",
                device_count=1,
                slots=1,
                started_at=at,
                last_heartbeat=at,
            )
        )

    def test_lost_leases_are_requeued_or_failed_and_fence_the_old_attempt(
        self,
        client: TestClient,
        sessions: sessionmaker[Session],
        db: Session,
        settings: Settings,
        tmp_path: Path,
    ) -> None:
        requeued, failed, healthy, vanished = (
            client.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(4)
        )
        self._beat(db, "dead:1", age=timedelta(minutes=2))
        self._beat(db, "alive:1", age=timedelta(seconds=1))
        old_token = self._running(db, requeued, worker="dead:1", max_restarts=1)
        self._running(db, failed, worker="dead:1", max_restarts=0)
        self._running(db, healthy, worker="alive:1", max_restarts=1)
        self._running(db, vanished, worker="gone:1", max_restarts=1)  # its row was removed
        # The dead attempts had reported step 37; only `requeued` had checkpoints (at 20 and 30).
        db.query(Job).filter(Job.id.in_([requeued, vanished])).update({"step": 37})
        for step in (20, 30):
            row = Checkpoint(
                job_id=requeued, attempt=1, step=step, path=f"/x/{step}", size_bytes=1, sha256="0"
            )
            db.add(row)
        db.commit()

        lost = recover_lost(sessions=sessions, lease_seconds=60)
        assert sorted(lost) == sorted([requeued, failed, vanished]), lost
        db.expire_all()
        states = {j: db.get(Job, j).status for j in (requeued, failed, healthy, vanished)}  # type: ignore[union-attr]
        assert states == {requeued: "queued", failed: "failed", healthy: "running", vanished: "queued"}, (
            states
        )
        # A requeued job shows the step it resumes from: the steps after its last checkpoint are lost.
        progress = {j: db.get(Job, j).step for j in (requeued, vanished)}  # type: ignore[union-attr]
        assert progress == {requeued: 30, vanished: 0}, (
            f"expected progress at the newest checkpoint, got {progress}"
        )
        failed_job = db.get(Job, failed)
        assert failed_job is not None
        error = JobError.model_validate(failed_job.error)
        assert error.type == "WorkerLost" and "no heartbeat" in error.message and error.rank is None, error
        reasons = [t.reason for t in db.query(JobTransition).filter_by(job_id=requeued, to_status="queued")]
        assert any("worker dead:1 lost" in (r or "") for r in reasons), reasons

        # The lost worker comes back: its token no longer owns the job, so it writes nothing.
        stale = Reporter(
            sessions=sessions, job_id=requeued, attempt=1, claim_token=old_token, run_dir=tmp_path
        )
        assert stale.flush() and stale.state.fenced_out
        assert recover_lost(sessions=sessions, lease_seconds=60) == []

    def test_one_lost_node_ends_the_attempt_on_every_node_and_frees_them(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session
    ) -> None:
        job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
        self._beat(db, "alive:1", age=timedelta(seconds=1))
        self._beat(db, "dead:2", age=timedelta(minutes=2))
        self._running(db, job_id, worker="alive:1", also="dead:2", max_restarts=1)
        db.commit()
        assert recover_lost(sessions=sessions, lease_seconds=60) == [job_id]
        db.expire_all()
        job = db.get(Job, job_id)
        assert job is not None and job.status == "queued" and job.claim_token is None
        assert "worker dead:2 lost" in (job.error or {}).get("message", ""), job.error
        assert db.query(JobNode).filter_by(job_id=job_id).count() == 0, "both nodes are free again"

    def test_a_job_this_worker_claimed_but_no_longer_runs_is_lost(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session, settings: Settings
    ) -> None:
        """The end state could not be recorded (a database outage longer than the runner retries)."""
        orphan, running = (client.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(2))
        self._beat(db, "me:1", age=timedelta(seconds=0))
        self._running(db, orphan, worker="me:1", max_restarts=1)
        self._running(db, running, worker="me:1", max_restarts=1)
        db.commit()
        lost = recover_lost(
            sessions=sessions,
            lease_seconds=60,
            me="me:1",
            running_here={(running, 1)},
        )
        assert lost == [orphan], f"only the job this worker no longer runs is lost, got {lost}"

    def test_a_starting_worker_ends_its_own_orphaned_runs_at_once_and_no_one_else_s(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session
    ) -> None:
        """At its start a worker runs nothing: its earlier process's runs are over, whatever the leases."""
        orphan, others, unstarted = (client.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(3))
        self._beat(db, "me:1", age=timedelta(seconds=0))
        self._beat(db, "dead:1", age=timedelta(minutes=2))
        self._running(db, orphan, worker="me:1", max_restarts=1)
        self._running(db, others, worker="dead:1", max_restarts=1)
        self._running(db, unstarted, worker="me:1", max_restarts=1)
        # Placed on this worker, its start message not taken yet: the new process will take it.
        db.query(JobNode).filter_by(job_id=unstarted).update({"started_at": None})
        db.commit()
        lost = recover_lost(sessions=sessions, lease_seconds=60, me="me:1", others=False)
        assert lost == [orphan], f"expected only this worker's started run, got {lost}"
        db.expire_all()
        states = {j: db.get(Job, j).status for j in (orphan, others, unstarted)}  # type: ignore[union-attr]
        assert states == {orphan: "queued", others: "running", unstarted: "running"}, states


def test_history_past_the_retention_is_deleted_and_the_job_row_kept(
    client: TestClient, sessions: sessionmaker[Session], db: Session
) -> None:
    old, recent, running = (client.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(3))
    db.query(Job).filter_by(id=old).update(
        {"status": "succeeded", "finished_at": utcnow() - timedelta(days=10)}
    )
    db.query(Job).filter_by(id=recent).update(
        {"status": "succeeded", "finished_at": utcnow() - timedelta(days=1)}
    )
    db.query(Job).filter_by(id=running).update({"status": "running"})
    for job_id in (old, recent, running):
        db.add(Metric(job_id=job_id, attempt=1, name="loss", step=1, value=1.0))
        db.add(LogLine(job_id=job_id, attempt=1, rank=0, line="hello"))
    db.commit()

    assert purge_expired(sessions=sessions, retention_days=0) == 0, "0 keeps everything"
    assert purge_expired(sessions=sessions, retention_days=7) == 1
    kept = {
        j: (db.query(Metric).filter_by(job_id=j).count(), db.query(LogLine).filter_by(job_id=j).count())
        for j in (old, recent, running)
    }
    assert kept == {old: (0, 0), recent: (1, 1), running: (1, 1)}, kept
    assert db.get(Job, old) is not None and db.query(JobTransition).filter_by(job_id=old).count() >= 1
    assert purge_expired(sessions=sessions, retention_days=7) == 0


def test_lost_leases_are_found_on_sqlite_too(tmp_path: Path) -> None:
    """The embedded service's SQLite hands back naive datetimes; the lease check must still work."""
    from api_schemas import JobSpec
    from migrations import upgrade
    from service.auth.tokens import ensure_bootstrap_admin
    from service.db import session_factory
    from service.jobs import submit
    from tests.api_fixtures import ADMIN_TOKEN

    url = f"sqlite:///{tmp_path / 'dptrain.db'}"
    upgrade(url)
    settings = Settings(database_url=url, home=tmp_path)
    sessions = session_factory(settings)
    ago = utcnow() - timedelta(minutes=5)
    with sessions.begin() as s:
        admin = ensure_bootstrap_admin(s, token=ADMIN_TOKEN)
        job_id = submit.submit(s, user=admin, spec=JobSpec.model_validate(SPEC), settings=settings)[0].id
        s.add(Worker(name="w:1", hostname="h", device="cpu", device_count=1, slots=1, last_heartbeat=ago))
    with sessions.begin() as s:
        _node(s, job_id, rank=0, worker="w:1")
        s.query(Job).filter_by(id=job_id).update(
            {"status": "running", "attempt": 1, "claim_token": "t" * 32, "worker": "w:1", "started_at": ago}
        )
    assert recover_lost(sessions=sessions, lease_seconds=60) == [job_id]
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "failed", "max_restarts 0: a lost worker fails the job"
