"""Placement on PostgreSQL: job_nodes rows, start messages, limits, freeing, and no double booking."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobSpec, JobStatus
from service.auth.tokens import ensure_bootstrap_admin
from service.config import Settings
from service.db import session_factory
from service.jobs import lifecycle, submit
from service.models import Job, JobNode, JobTransition, Worker
from service.models.base import utcnow
from service.scheduling import repository
from service.scheduling.service import republish_unstarted, schedule_once
from tests.api_fixtures import ADMIN_TOKEN, SPEC, RecordingDispatcher, add_user, as_user, register_node


def _spec(name: str, *, nodes: int = 1, ppn: int = 1, priority: int = 0) -> dict[str, object]:
    return {
        **SPEC,
        "name": name,
        "priority": priority,
        "resources": {"nodes": nodes, "processes_per_node": ppn},
    }


def _job(db: Session, job_id: str) -> Job:
    db.expire_all()
    job = db.get(Job, job_id)
    assert job is not None
    return job


class TestPlacement:
    def test_a_two_node_job_gets_a_row_and_a_start_per_node_and_a_rendezvous_port(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session, settings: Settings
    ) -> None:
        register_node(sessions, name="a", slots=2, address="10.0.0.1")
        register_node(sessions, name="b", slots=2, address="10.0.0.2")
        job_id = client.post("/v1/jobs", json=_spec("wide", nodes=2, ppn=2)).json()["id"]
        sent = RecordingDispatcher()
        assert schedule_once(sessions=sessions, dispatcher=sent, settings=settings) == [job_id]
        job = _job(db, job_id)
        assert (job.status, job.attempt, job.worker, job.queued_reason) == ("running", 1, "a", None)
        rows = db.execute(select(JobNode).order_by(JobNode.node_rank)).scalars().all()
        got = [(r.node_rank, r.worker, r.slots, r.address, r.port, r.attempt) for r in rows]
        assert got == [
            (0, "a", 2, "10.0.0.1", settings.rendezvous_port_min, 1),
            (1, "b", 2, "10.0.0.2", None, 1),
        ]
        rdzv = f"10.0.0.1:{settings.rendezvous_port_min}"
        got_starts = [(s.worker, s.node_rank, s.attempt, s.endpoint) for s in sent.starts]
        assert got_starts == [("a", 0, 1, rdzv), ("b", 1, 1, rdzv)], (
            "each node's message names the rendezvous"
        )
        # Leaving `running` frees every node of the attempt.
        with sessions.begin() as s:
            lifecycle.transition(s, job_id=job_id, src=JobStatus.RUNNING, dst=JobStatus.FAILED)
        assert db.execute(select(func.count()).select_from(JobNode)).scalar() == 0

    def test_each_running_multi_node_job_gets_one_uid_of_the_cluster_range_none_other_holds(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session, settings: Settings
    ) -> None:
        # A range of two uids: two two-node jobs run on four nodes, each with its own uid on every
        # row; a third waits for a uid, saying so, and takes the one a finished job frees.
        narrow = settings.model_copy(update={"cluster_rank_uid_range": "70100-70101"})
        for name in "abcdef":
            register_node(sessions, name=name, slots=1, address=f"10.0.0.{ord(name)}")
        jobs = [client.post("/v1/jobs", json=_spec(f"wide-{i}", nodes=2)).json()["id"] for i in range(3)]
        assert schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=narrow) == jobs[:2]
        rows = db.execute(select(JobNode)).scalars().all()
        uids = {job_id: {r.rank_uid for r in rows if r.job_id == job_id} for job_id in jobs[:2]}
        assert all(len(u) == 1 for u in uids.values()), f"one uid on every node of a job: {uids}"
        assert {u for (u,) in uids.values()} == {70100, 70101}, uids
        waiting = client.get(f"/v1/jobs/{jobs[2]}").json()
        assert waiting["status"] == "queued", waiting
        assert "DPTRAIN_CLUSTER_RANK_UID_RANGE" in waiting["queued_reason"], waiting
        # One job ends: its uid is free again, and the third job gets it.
        (freed,) = uids[jobs[0]]
        with sessions.begin() as s:
            lifecycle.transition(s, job_id=jobs[0], src=JobStatus.RUNNING, dst=JobStatus.FAILED)
        assert schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=narrow) == [
            jobs[2]
        ]
        db.expire_all()
        third = {r.rank_uid for r in db.execute(select(JobNode).where(JobNode.job_id == jobs[2])).scalars()}
        assert third == {freed}, third
        # A one-node job gets none: its node leases a uid of its own host's range.
        one = client.post("/v1/jobs", json=_spec("narrow")).json()["id"]
        assert schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=narrow) == [one]
        db.expire_all()
        assert [r.rank_uid for r in db.execute(select(JobNode).where(JobNode.job_id == one)).scalars()] == [
            None
        ]

    def test_higher_priority_first_then_oldest(
        self, client: TestClient, sessions: sessionmaker[Session], settings: Settings
    ) -> None:
        register_node(sessions, name="one", slots=1)
        old = client.post("/v1/jobs", json=_spec("old")).json()["id"]
        urgent = client.post("/v1/jobs", json=_spec("urgent", priority=5)).json()["id"]
        sent = RecordingDispatcher()
        assert schedule_once(sessions=sessions, dispatcher=sent, settings=settings) == [urgent]
        waiting = client.get(f"/v1/jobs/{old}").json()
        assert waiting["queued_reason"] == "waiting for 1 node with 1 free cpu slot: 0 such now", waiting

    def test_the_running_limit_holds_back_one_owner_only(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session, settings: Settings
    ) -> None:
        register_node(sessions, name="big", slots=8)
        kim = as_user(add_user(db, "kim"))
        ids = [client.post("/v1/jobs", json=_spec(f"k{i}"), headers=kim).json()["id"] for i in range(3)]
        leo = client.post("/v1/jobs", json=_spec("leo"), headers=as_user(add_user(db, "leo"))).json()["id"]
        limited = settings.model_copy(update={"max_running_jobs_per_user": 2})
        placed = schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=limited)
        # leo's first job comes before kim's second: each owner's first queued job, then the seconds.
        assert placed == [ids[0], leo, ids[1]], placed
        assert _job(db, ids[2]).queued_reason == "waiting: its owner has 2 jobs running, the limit is 2"
        with sessions.begin() as s:
            lifecycle.transition(s, job_id=ids[0], src=JobStatus.RUNNING, dst=JobStatus.SUCCEEDED)
        assert schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=limited) == [
            ids[2]
        ]

    def test_a_round_claims_its_jobs_together_each_with_its_own_attempt_token_and_timeline(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session, settings: Settings
    ) -> None:
        register_node(sessions, name="wide", slots=8)
        ids = [client.post("/v1/jobs", json=_spec(f"j{i}", ppn=2)).json()["id"] for i in range(3)]
        sent = RecordingDispatcher()
        assert schedule_once(sessions=sessions, dispatcher=sent, settings=settings) == ids
        jobs = [_job(db, i) for i in ids]
        assert [(j.status, j.attempt, j.worker) for j in jobs] == [("running", 1, "wide")] * 3
        assert len({j.claim_token for j in jobs}) == 3 and all(j.claim_token for j in jobs)
        for job_id in ids:
            (last,) = db.scalars(
                select(JobTransition).where(
                    JobTransition.job_id == job_id, JobTransition.to_status == "running"
                )
            )
            assert (last.from_status, last.attempt, last.reason) == ("queued", 1, "placed on wide")

    def test_a_job_cancelled_after_the_round_read_it_is_not_claimed(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session
    ) -> None:
        kept, gone = (client.post("/v1/jobs", json=_spec(n)).json()["id"] for n in ("kept", "gone"))
        client.post(f"/v1/jobs/{gone}/cancel")
        with sessions.begin() as s:
            claimed = lifecycle.claim_many(
                s, workers={kept: "n0", gone: "n0"}, reasons={kept: "placed on n0"}
            )
        assert claimed == {kept: 1}, claimed
        assert (_job(db, kept).status, _job(db, gone).status) == ("running", "cancelled")

    def test_a_node_that_stopped_beating_gets_nothing(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session, settings: Settings
    ) -> None:
        register_node(sessions, name="stale", slots=4)
        with sessions.begin() as s:
            s.query(Worker).filter_by(name="stale").update(
                {"last_heartbeat": utcnow() - timedelta(minutes=1)}
            )
        job_id = client.post("/v1/jobs", json=_spec("orphan")).json()["id"]
        assert schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=settings) == []
        assert "no live cpu node" in (_job(db, job_id).queued_reason or "")

    def test_a_start_is_accepted_once_and_only_for_its_attempt_and_node(
        self, client: TestClient, sessions: sessionmaker[Session], settings: Settings
    ) -> None:
        register_node(sessions, name="solo", slots=1)
        job_id = client.post("/v1/jobs", json=_spec("once")).json()["id"]
        schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=settings)

        def accept(attempt: int, worker: str) -> bool:
            with sessions.begin() as s:
                return repository.accept(
                    s, job_id=job_id, attempt=attempt, node_rank=0, worker=worker, now=utcnow()
                )

        assert not accept(2, "solo"), "another attempt's message"
        assert not accept(1, "other"), "a message for another node"
        assert accept(1, "solo")
        assert not accept(1, "solo"), "a duplicate delivery"

    def test_a_lost_start_message_is_sent_again(
        self, client: TestClient, sessions: sessionmaker[Session], settings: Settings
    ) -> None:
        register_node(sessions, name="solo", slots=1)
        job_id = client.post("/v1/jobs", json=_spec("lost-message")).json()["id"]
        schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=settings)
        again = RecordingDispatcher()
        assert republish_unstarted(sessions=sessions, dispatcher=again, after_seconds=600) == []
        assert [
            s.job_id for s in republish_unstarted(sessions=sessions, dispatcher=again, after_seconds=0)
        ] == [job_id]
        assert again.sent == [job_id]


@pytest.fixture(scope="module")
def committed(
    own_database: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[sessionmaker[Session], Settings]:
    """A database of its own: concurrent placements need real commits on separate connections."""
    settings = Settings(database_url=own_database, home=tmp_path_factory.mktemp("placement"))
    return session_factory(settings), settings


def test_concurrent_placements_never_hand_out_a_slot_twice(
    committed: tuple[sessionmaker[Session], Settings],
) -> None:
    sessions, settings = committed
    register_node(sessions, name="x", slots=2)
    register_node(sessions, name="y", slots=2)
    with sessions.begin() as s:
        admin = ensure_bootstrap_admin(s, token=ADMIN_TOKEN)
        for i in range(12):
            submit.submit(s, user=admin, spec=JobSpec.model_validate(_spec(f"race-{i}")), settings=settings)
    roomy = settings.model_copy(update={"max_running_jobs_per_user": 100})
    barrier = threading.Barrier(4)
    placed: list[str] = []

    def round_() -> None:
        barrier.wait(timeout=30)
        placed.extend(schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=roomy))

    threads = [threading.Thread(target=round_) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(placed) == len(set(placed)) == 4, f"4 slots in all, each handed out once: {placed}"
    with sessions() as s:
        used = repository.used_slots(s)
    assert used == {"x": 2, "y": 2}, used
