"""A job's metric points are bounded: DPTRAIN_MAX_METRIC_POINTS_PER_JOB across attempts and nodes (issue 38).

Past the cap, points are dropped and the job is told once (a timeline note and a log line); its
progress still moves. On the real PostgreSQL of the test run.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from rank_contract.layout import RunFiles
from service.models import Job, JobTransition, LogLine, Metric
from tests.conftest import job_spec
from workers.reporting.metric_budget import CAP_SETTING, MetricBudget
from workers.reporting.reporter import Reporter

SPEC = job_spec(name="flood", hyperparameters={"global_batch_size": 4, "steps": 3})
TOKEN = "t" * 32


class TestBudget:
    def test_points_are_kept_in_order_until_the_limit_and_the_job_is_told_once(self) -> None:
        budget = MetricBudget(cap=10)
        budget.start(stored=4, nodes=1)
        rows = [{"step": i} for i in range(8)]
        assert budget.admit(rows) == rows[:6]
        assert budget.warning() is not None and budget.warning() is None, "one warning"
        assert budget.admit([{"step": 9}]) == [] and budget.dropped == 3

    def test_a_job_full_before_this_attempt_is_not_told_again(self) -> None:
        budget = MetricBudget(cap=10)
        budget.start(stored=10, nodes=1)
        assert budget.admit([{"step": 1}]) == [] and budget.warning() is None

    def test_the_nodes_of_an_attempt_share_what_is_left(self) -> None:
        budgets = [MetricBudget(cap=100) for _ in range(3)]
        for b in budgets:
            b.start(stored=40, nodes=3)
        assert sum(len(b.admit([{"step": i} for i in range(100)])) for b in budgets) == 60


def _running(client: TestClient, db: Session, attempt: int, job_id: str | None = None) -> str:
    job_id = job_id or client.post("/v1/jobs", json=SPEC).json()["id"]
    db.query(Job).filter_by(id=job_id).update(
        {"status": JobStatus.RUNNING.value, "attempt": attempt, "claim_token": TOKEN}
    )
    db.add(JobTransition(job_id=job_id, from_status="queued", to_status="running", attempt=attempt))
    db.commit()
    return job_id


def _flood(run_dir: Path, first: int, steps: int) -> None:
    path = RunFiles(run_dir).rank_events(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    with path.open("a") as f:
        for s in range(first, first + steps):
            f.write(json.dumps({"type": "metrics", "step": s, "values": {"a": 1.0, "b": 2.0}}) + "\n")


def test_a_flood_stores_the_cap_across_attempts_with_one_warning(
    client: TestClient, sessions: sessionmaker[Session], db: Session, tmp_path: Path
) -> None:
    job_id = _running(client, db, 1)
    reporter = Reporter(
        sessions=sessions,
        job_id=job_id,
        attempt=1,
        claim_token=TOKEN,
        run_dir=tmp_path / "a1",
        max_metric_points=1000,
    )
    for tick in range(5):  # 5,000 points over five ticks
        _flood(tmp_path / "a1", 1 + tick * 500, 500)
        reporter.collect()
        assert reporter.flush()
    db.expire_all()
    job = db.get(Job, job_id)
    assert job is not None and job.step == 2500, "progress moves past the cap"
    db.query(Job).filter_by(id=job_id).update({"status": JobStatus.QUEUED.value})
    db.commit()

    _running(client, db, 2, job_id)
    again = Reporter(
        sessions=sessions,
        job_id=job_id,
        attempt=2,
        claim_token=TOKEN,
        run_dir=tmp_path / "a2",
        max_metric_points=1000,
    )
    _flood(tmp_path / "a2", 2501, 100)
    again.collect(final=True)
    assert again.flush()

    db.expire_all()
    stored = db.execute(select(func.count()).select_from(Metric).where(Metric.job_id == job_id)).scalar_one()
    assert stored == 1000, f"expected exactly the cap of 1000 points stored, found {stored}"
    reasons = [t.reason or "" for t in db.query(JobTransition).filter_by(job_id=job_id)]
    notes = [r for r in reasons if CAP_SETTING in r]
    assert len(notes) == 1 and all(r.count(CAP_SETTING) == 1 for r in notes), reasons
    lines = [ln.line for ln in db.query(LogLine).filter_by(job_id=job_id) if CAP_SETTING in ln.line]
    assert len(lines) == 1 and lines[0].startswith("[dptrain] "), lines
