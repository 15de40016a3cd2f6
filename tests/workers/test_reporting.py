"""The reporter turns rank events into SQL rows; values JSON cannot carry, and bad lines, are kept out."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from rank_contract.layout import RunFiles
from service.models import Checkpoint, Job, LogLine, Metric
from tests.conftest import job_spec
from workers.engine.checkpoint import checkpoint_name
from workers.engine.events import (
    CheckpointEvent,
    EventWriter,
    FinishedEvent,
    MetricsEvent,
    StartedEvent,
)
from workers.reporting.reporter import Reporter

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
        {"type": "checkpoint", "step": 2, "size_bytes": 9, "sha256": "c" * 64, "time": 4.0},
    ]
    (tmp_path / "events" / "rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "logs" / "rank1.log").write_text("hello\npartial")
    (ckpts := tmp_path / "checkpoints").mkdir()
    (ckpts / checkpoint_name(2)).write_bytes(b"x" * 9)

    reporter = Reporter(
        sessions=sessions,
        job_id=job_id,
        attempt=1,
        claim_token="t" * 32,
        run_dir=tmp_path,
        checkpoint_dir=ckpts,
    )
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


def _running(client: TestClient, db: Session) -> str:
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    db.query(Job).filter_by(id=job_id).update(
        {"status": JobStatus.RUNNING.value, "attempt": 1, "claim_token": "t" * 32}
    )
    db.commit()
    return job_id


def test_every_event_a_rank_writes_reaches_the_reporter(
    client: TestClient, sessions: sessionmaker[Session], db: Session, tmp_path: Path
) -> None:
    job_id = _running(client, db)
    ckpts = tmp_path / "checkpoints"
    pruned, saved = ckpts / checkpoint_name(2), ckpts / checkpoint_name(6)
    db.add(Checkpoint(job_id=job_id, attempt=1, step=2, path=str(pruned), size_bytes=1, sha256="0" * 64))
    db.commit()
    ckpts.mkdir()
    saved.write_bytes(b"x" * 9)
    writer = EventWriter(RunFiles(tmp_path).rank_events(0), 0)
    writer.emit(StartedEvent(world_size=2, start_iter=4, total_steps=10, device="cpu", backend="gloo"))
    writer.emit_many([MetricsEvent(step=s, values={"loss": 1 / s, "lr": 0.1}) for s in (5, 6)])
    writer.emit(CheckpointEvent(step=6, size_bytes=9, sha256="a" * 64, deleted=[2]))
    writer.emit(FinishedEvent(step=10))
    try:
        raise ValueError("bad hyperparameter")
    except ValueError as exc:
        writer.error(exc)
    writer.close()

    reporter = Reporter(
        sessions=sessions,
        job_id=job_id,
        attempt=1,
        claim_token="t" * 32,
        run_dir=tmp_path,
        checkpoint_dir=ckpts,
    )
    reporter.collect()
    assert reporter.flush()

    state = reporter.state
    assert state.started and state.finished and state.step == 10, state
    assert state.latest_metrics == {"loss": 1 / 6, "lr": 0.1}, state.latest_metrics
    error = reporter.root_error()
    assert error is not None and (error.type, error.message, error.rank) == (
        "ValueError",
        "bad hyperparameter",
        0,
    )
    db.expire_all()
    points = sorted((m.name, m.step, m.value) for m in db.query(Metric).filter_by(job_id=job_id))
    assert points == [("loss", 5, 0.2), ("loss", 6, 1 / 6), ("lr", 5, 0.1), ("lr", 6, 0.1)], points
    rows = [(c.step, c.path, c.size_bytes) for c in db.query(Checkpoint).filter_by(job_id=job_id)]
    assert rows == [(6, str(saved), 9)], (
        f"expected the new checkpoint's row and the pruned one's gone: {rows}"
    )
    job = db.get(Job, job_id)
    assert job is not None and job.step == 10, "the finished step is the job's progress"


def test_a_bad_line_is_skipped_with_a_warning_and_the_rest_is_read(
    client: TestClient,
    sessions: sessionmaker[Session],
    db: Session,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    job_id = _running(client, db)
    good = [MetricsEvent(step=s, values={"loss": float(s)}).model_dump_json() for s in (1, 2, 3)]
    lines = [
        good[0],
        "not json",
        '{"type": "teleported", "time": 1.0}',
        '{"type": "metrics", "time": 1.0, "values": {"loss": 9.0}}',
        good[1],
        good[2][:-5],  # the last line, cut short by a rank that died mid-write
    ]
    RunFiles(tmp_path).rank_events(0).parent.mkdir(parents=True)
    RunFiles(tmp_path).rank_events(0).write_text("\n".join(lines))
    reporter = Reporter(sessions=sessions, job_id=job_id, attempt=1, claim_token="t" * 32, run_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="workers.reporting.reporter"):
        reporter.collect(final=True)
    assert reporter.flush()

    skipped = [r.getMessage() for r in caplog.records if "skipped an event in rank0.jsonl" in r.getMessage()]
    assert len(skipped) == 4, f"expected a warning for each of the 4 bad lines, got {skipped}"
    assert any("step: Field required" in m for m in skipped), skipped
    db.expire_all()
    steps = sorted(m.step for m in db.query(Metric).filter_by(job_id=job_id))
    assert steps == [1, 2], f"expected the good lines' steps around the bad ones, got {steps}"
