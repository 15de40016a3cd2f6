"""Faults during a run, on real processes: a private PostgreSQL and Redis that the tests stop and start.

One stack for the module (API + worker), with short heartbeats, leases and reconcile intervals, and
every step slowed by the `sleep` fault so that a fault lands mid-run. The republish of lost starts
keeps its default of 10 minutes: a start that failed for a broker outage must not wait for it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.db import session_factory
from service.dispatch import RUN_NODE_TASK, CeleryDispatcher, node_queue
from service.models.workers import JobNode
from tests.conftest import job_spec
from tests.e2e.helpers import wait_for_terminal
from tests.e2e.services import PrivatePostgres, PrivateRedis
from tests.e2e.stack import Stack, running_stack
from workers.sandbox.procs import rank_processes

pytestmark = pytest.mark.e2e

STEPS = 30
# A lost start is sent again after this long (the default): a node placed while the broker was down
# must not wait for it.
REPUBLISH_SECONDS = 600
BROKER_DOWN_SECONDS = 10
START_WITHIN_SECONDS = 30


def _spec(name: str, **over: Any) -> dict[str, Any]:
    spec = job_spec(
        name=name,
        hyperparameters={"global_batch_size": 8, "steps": STEPS, "lr": 0.1, "hidden_size": 8},
        resources={"processes_per_node": 2, "device": "cpu"},
        engine={"log_every_steps": 1},
        checkpoint={"every_steps": 5, "keep_last": 3},
        max_restarts=1,
    )
    spec.update(over)  # a section given here replaces the whole section
    return spec


class Faulty:
    """The stack plus handles on its private servers."""

    def __init__(self, stack: Stack, pg: PrivatePostgres, redis: PrivateRedis) -> None:
        self.stack, self.pg, self.redis = stack, pg, redis
        self.http, self.procs = stack.http, stack.procs
        self.sessions: sessionmaker[Session] = session_factory(Settings(database_url=stack.db_url))

    def submit(self, name: str, **over: Any) -> str:
        r = self.http.post("/v1/jobs", json=_spec(name, **over))
        assert r.status_code == 201, f"expected 201, got {r.status_code}: {r.text}"
        return str(r.json()["id"])

    def wait_step(self, job_id: str, step: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.http.get(f"/v1/jobs/{job_id}").json()
            if job["progress"]["step"] >= step and job["status"] == "running":
                return
            self.procs.check_alive()
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} did not reach step {step}:\n{self.procs.logs()}")

    def node_started(self, job_id: str) -> bool:
        """Whether the worker has started the job's placed node (its start message came)."""
        with self.sessions() as session:
            stmt = select(JobNode.started_at).where(JobNode.job_id == job_id, JobNode.node_rank == 0)
            started: datetime | None = session.execute(stmt).scalar_one_or_none()
        # The node's row goes with its attempt's end: a job no longer running has run.
        return started is not None or self.http.get(f"/v1/jobs/{job_id}").json()["status"] != "running"

    def timeline(self, job_id: str) -> list[dict[str, Any]]:
        return list(self.http.get(f"/v1/jobs/{job_id}/timeline").json()["items"])

    def assert_complete_metrics(self, job_id: str) -> None:
        series = self.http.get(f"/v1/jobs/{job_id}/metrics", params={"name": "loss"}).json()["series"]
        steps = [s for s, _ in series["loss"]]
        assert steps == list(range(1, STEPS + 1)), f"expected a loss point for every step, got {steps}"


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    tmp = tmp_path_factory.mktemp("faults")
    pg = PrivatePostgres()
    redis = PrivateRedis(tmp)
    try:
        pg.start()
        redis.start()
        db_url = pg.create_database("dptrain_faults")
        with running_stack(
            tmp,
            broker_url=redis.url,
            db_url=db_url,
            DPTRAIN_WORKER_HEARTBEAT_SECONDS="0.5",
            DPTRAIN_WORKER_LEASE_SECONDS="5",
            DPTRAIN_FAULT_INJECT="sleep:ms=100",
            DPTRAIN_REPUBLISH_AFTER_SECONDS=str(REPUBLISH_SECONDS),
        ) as stack:
            yield Faulty(stack, pg, redis)
    finally:
        redis.stop()
        pg.destroy()


def test_the_same_celery_message_delivered_twice_runs_once(faulty: Faulty) -> None:
    job_id = faulty.submit("duplicate", hyperparameters={"global_batch_size": 8, "steps": 20})
    faulty.wait_step(job_id, 1)
    settings = Settings(
        database_url=faulty.stack.db_url, broker_url=faulty.redis.url, queue=faulty.stack.env["DPTRAIN_QUEUE"]
    )
    app = CeleryDispatcher(settings).app
    # The start placement sent, delivered twice more (a redelivery after a broker hiccup).
    task_id = str(uuid.uuid4())
    for _ in range(2):
        app.send_task(
            RUN_NODE_TASK, args=[job_id, 1, 0], queue=node_queue(settings.queue, "worker"), task_id=task_id
        )
    job = wait_for_terminal(faulty.http, job_id, procs=faulty.procs)
    assert job["status"] == "succeeded" and job["attempt"] == 1, job
    deadline = time.monotonic() + 30
    while faulty.procs.logs().count("not ours to start") < 2 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert faulty.procs.logs().count("not ours to start") >= 2, "both extra deliveries must be refused"
    assert [t["to_status"] for t in faulty.timeline(job_id)] == ["queued", "running", "succeeded"]


def test_a_job_placed_while_redis_is_down_starts_within_seconds_of_its_return(faulty: Faulty) -> None:
    faulty.redis.stop()
    try:
        down = time.monotonic()
        job_id = faulty.submit("broker-down", hyperparameters={"global_batch_size": 8, "steps": 3})
        assert time.monotonic() - down < 25, "the submit must not hang on the broker"
        # Placement needs no broker: the job is placed (its slots held) while no start can be sent.
        deadline = time.monotonic() + 20
        while faulty.http.get(f"/v1/jobs/{job_id}").json()["status"] != "running":
            assert time.monotonic() < deadline, f"job {job_id} was not placed:\n{faulty.procs.logs()}"
            time.sleep(0.2)
        time.sleep(max(0.0, down + BROKER_DOWN_SECONDS - time.monotonic()))
        assert not faulty.node_started(job_id), "a node started with no broker to carry its start"
    finally:
        faulty.redis.start()
    back = time.monotonic()
    while not faulty.node_started(job_id) and time.monotonic() - back < START_WITHIN_SECONDS:
        faulty.procs.check_alive()
        time.sleep(0.3)
    assert faulty.node_started(job_id), (
        f"a job placed during a {BROKER_DOWN_SECONDS} s broker outage must start within "
        f"{START_WITHIN_SECONDS} s of the broker's return (not at the reconciler's republish "
        f"after {REPUBLISH_SECONDS} s); it had not:\n{faulty.procs.logs()}"
    )
    job = wait_for_terminal(faulty.http, job_id, procs=faulty.procs, timeout=120)
    assert job["status"] == "succeeded" and job["attempt"] == 1, job
    assert [t["to_status"] for t in faulty.timeline(job_id)] == ["queued", "running", "succeeded"]


def test_postgres_restarted_mid_run_the_job_succeeds_with_all_its_metrics(faulty: Faulty) -> None:
    job_id = faulty.submit("pg-restart")
    faulty.wait_step(job_id, 5)
    faulty.pg.stop()
    time.sleep(2)  # steps go on meanwhile; their reports wait
    faulty.pg.start()
    job = wait_for_terminal(faulty.http, job_id, procs=faulty.procs)
    assert job["status"] == "succeeded" and job["attempt"] == 1, (job, faulty.procs.logs())
    assert job["progress"]["step"] == STEPS
    faulty.assert_complete_metrics(job_id)


def test_redis_restarted_mid_run_the_job_succeeds_once(faulty: Faulty) -> None:
    job_id = faulty.submit("redis-restart")
    faulty.wait_step(job_id, 5)
    faulty.redis.stop()  # no persistence: the job's unacked message is gone with it
    time.sleep(2)
    faulty.redis.start()
    job = wait_for_terminal(faulty.http, job_id, procs=faulty.procs)
    assert job["status"] == "succeeded" and job["attempt"] == 1, (job, faulty.procs.logs())
    assert [t["to_status"] for t in faulty.timeline(job_id)] == ["queued", "running", "succeeded"]
    faulty.assert_complete_metrics(job_id)


def test_a_sigkilled_worker_s_job_is_taken_up_by_a_restarted_worker(faulty: Faulty) -> None:
    job_id = faulty.submit("worker-killed", hyperparameters={"global_batch_size": 8, "steps": 60})
    faulty.wait_step(job_id, 8)
    faulty.procs.kill("worker")
    # torchrun has a session of its own, so the kill does not reach the ranks: they notice that
    # their supervisor is gone and exit, rather than train on beside the next attempt.
    deadline = time.monotonic() + 10
    while rank_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rank_processes(job_id) == [], "the ranks of a killed worker must stop on their own"
    faulty.stack.start_worker("worker-2")
    job = wait_for_terminal(faulty.http, job_id, procs=faulty.procs, timeout=150)
    assert job["status"] == "succeeded" and job["attempt"] == 2, (job, faulty.procs.logs())
    assert job["progress"]["step"] == 60
    reasons = [t["reason"] or "" for t in faulty.timeline(job_id) if t["to_status"] == "queued"]
    assert any("lost" in r for r in reasons), f"expected a restart for a lost worker, got {reasons}"
    assert rank_processes(job_id) == [], "no process of either attempt may be left"
    ckpts = faulty.http.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
    assert [c["step"] for c in ckpts] == [50, 55, 60], f"the last 3 checkpoints (keep_last), got {ckpts}"
