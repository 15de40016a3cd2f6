"""The reporter turns rank events into SQL rows; values JSON cannot carry are kept out of the batch."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service.models import Checkpoint, Job, LogLine, Metric
from tests.conftest import job_spec
from workers.reporting import Reporter

SPEC = job_spec(name="r", hyperparameters={"global_batch_size": 4, "steps": 3})


def test_events_and_logs_become_rows_and_nan_does_not_block_the_batch(
    client: TestClient, sessions: sessionmaker[Session], db: Session, tmp_path: Path
) -> None:
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    db.query(Job).filter_by(id=job_id).update({"status": "running", "attempt": 1, "claim_token": "t" * 32})
    db.commit()
    (tmp_path / "events").mkdir()
    (tmp_path / "logs").mkdir()
    events = [
        {"type": "started", "start_iter": 0, "time": 1.0},
        {"type": "metrics", "step": 1, "values": {"loss": 2.0, "lr": 0.1}, "time": 2.0},
        {"type": "metrics", "step": 2, "values": {"loss": float("nan"), "lr": 0.1}, "time": 3.0},
        {
            "type": "checkpoint",
            "step": 2,
            "path": "/x/ckpt-2.pt",
            "size_bytes": 9,
            "sha256": "c" * 64,
            "time": 4.0,
        },
    ]
    (tmp_path / "events" / "rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "logs" / "rank1.log").write_text("hello\npartial")

    reporter = Reporter(sessions=sessions, job_id=job_id, attempt=1, claim_token="t" * 32, run_dir=tmp_path)
    reporter.collect()
    assert reporter.flush(), "a batch with a NaN value must still commit"

    db.expire_all()
    job = db.get(Job, job_id)
    assert job is not None and job.step == 2 and job.latest_metrics == {"loss": 2.0, "lr": 0.1}
    points = sorted((m.name, m.step, m.value) for m in db.query(Metric).filter_by(job_id=job_id))
    assert points == [("loss", 1, 2.0), ("lr", 1, 0.1), ("lr", 2, 0.1)]
    assert [c.step for c in db.query(Checkpoint).filter_by(job_id=job_id)] == [2]
    lines = [(ln.rank, ln.line) for ln in db.query(LogLine).filter_by(job_id=job_id)]
    assert lines == [(1, "hello")], "a partial last line waits for its newline"

    reporter.collect(final=True)
    assert reporter.flush()
    lines = [(ln.rank, ln.line) for ln in db.query(LogLine).filter_by(job_id=job_id).order_by(LogLine.id)]
    assert lines == [(1, "hello"), (1, "partial")], "the final read takes the partial line too"


def test_a_stale_attempt_is_fenced_out(
    client: TestClient, sessions: sessionmaker[Session], db: Session
) -> None:
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    db.query(Job).filter_by(id=job_id).update({"status": "running", "claim_token": "new" + "0" * 29})
    db.commit()
    reporter = Reporter(
        sessions=sessions,
        job_id=job_id,
        attempt=1,
        claim_token="old" + "0" * 29,
        run_dir=Path("/nonexistent"),
    )
    assert reporter.flush()
    assert reporter.state.fenced_out, "a worker whose token is no longer the job's must stop"
