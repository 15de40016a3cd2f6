"""How an attempt ends: every abnormal end is recorded as a `JobError` body, requeued or failed by type."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from rank_contract.layout import RunFiles
from service.models import Job, JobTransition
from service.models.base import utcnow
from workers.attempt.end import WORKER_STOPPED, end_abnormally, is_retryable, launcher_error
from workers.attempt.node_run import Attempt
from workers.engine.events import EventWriter
from workers.reporting.reporter import Reporter

SPEC = {"name": "a", "recipe": "mlp", "hyperparameters": {"global_batch_size": 4, "steps": 1}}


def _rank_error(sessions: sessionmaker[Session], run_dir: Path) -> JobError:
    """What the runner records when rank 1 raised: its error event, read back by the reporter."""
    writer = EventWriter(RunFiles(run_dir).rank_events(1), 1)
    try:
        raise RuntimeError("injected fault at step 2")
    except RuntimeError as exc:
        writer.error(exc)
    writer.close()
    reporter = Reporter(sessions=sessions, job_id="j", attempt=1, claim_token="t", run_dir=run_dir)
    reporter.collect(final=True)
    error = reporter.root_error()
    assert error is not None, "expected the rank's error event to be read"
    return error


def _rendezvous_failed(run_dir: Path) -> JobError:
    log = run_dir / "launcher.log"
    log.write_text("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n")
    return launcher_error(log, rc=1, started=False)


ABNORMAL_ENDS: dict[str, Callable[[sessionmaker[Session], Path], JobError]] = {
    "rank-error": _rank_error,
    "rendezvous-failed": lambda _, run_dir: _rendezvous_failed(run_dir),
    "ranks-exited": lambda _, run_dir: launcher_error(run_dir / "absent.log", rc=-9, started=True),
    "ranks-ended-early": lambda _, run_dir: launcher_error(run_dir / "absent.log", rc=0, started=True),
    "not-retried": lambda *_: JobError(type="FloatingPointError", message="non-finite loss", rank=0),
}


@pytest.mark.parametrize("restarts", [0, 1], ids=["no-restart-left", "restart-left"])
@pytest.mark.parametrize("end", list(ABNORMAL_ENDS))
def test_the_error_column_holds_a_job_error_and_the_api_shows_it(
    client: TestClient, sessions: sessionmaker[Session], db: Session, tmp_path: Path, end: str, restarts: int
) -> None:
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    token = uuid.uuid4().hex
    db.query(Job).filter_by(id=job_id).update(
        {
            "status": JobStatus.RUNNING.value,
            "attempt": 1,
            "claim_token": token,
            "worker": "w:1",
            "max_restarts": restarts,
            "started_at": utcnow(),
        }
    )
    db.commit()
    error = ABNORMAL_ENDS[end](sessions, tmp_path)
    att = Attempt(job_id=job_id, number=1, token=token, max_restarts=restarts)

    status = end_abnormally(sessions, att=att, error=error)

    want = JobStatus.QUEUED if restarts and is_retryable(error) else JobStatus.FAILED
    assert status is want, f"{end}: expected {want}, got {status}"
    db.expire_all()
    job = db.get(Job, job_id)
    assert job is not None and job.status == want.value, job
    assert JobError.model_validate(job.error) == error, f"{end}: the column holds {job.error}"
    shown = client.get(f"/v1/jobs/{job_id}").json()["error"]
    assert shown == error.model_dump(), f"{end}: expected the API to show {error}, got {shown}"


def test_a_stopped_worker_s_attempt_is_requeued_and_costs_the_job_no_restart(
    client: TestClient, sessions: sessionmaker[Session], db: Session
) -> None:
    """A service stop is not the job's failure: with max_restarts 1 it still gets its one restart after."""
    job_id = client.post("/v1/jobs", json={**SPEC, "max_restarts": 1}).json()["id"]
    stopped = JobError(type=WORKER_STOPPED, message="its worker was stopped")
    crashed = JobError(type="RuntimeError", message="injected fault at step 2", rank=0)
    ends = []
    for number, error in enumerate((stopped, crashed, crashed), start=1):
        token = uuid.uuid4().hex  # a new attempt, as placement's claim makes it
        db.query(Job).filter_by(id=job_id).update(
            {"status": "running", "attempt": number, "claim_token": token, "started_at": utcnow()}
        )
        db.commit()
        max_restarts = db.get(Job, job_id).max_restarts  # type: ignore[union-attr]
        att = Attempt(job_id=job_id, number=number, token=token, max_restarts=max_restarts)
        ends.append(end_abnormally(sessions, att=att, error=error))
        db.expire_all()
    assert ends == [JobStatus.QUEUED, JobStatus.QUEUED, JobStatus.FAILED], ends
    reasons = [
        t.reason or "" for t in db.query(JobTransition).filter_by(job_id=job_id).order_by(JobTransition.id)
    ]
    assert "requeued after attempt 1, not counted as a restart: WorkerStopped" in reasons[-3], reasons
    assert "restarting after attempt 2 of 3: RuntimeError" in reasons[-2], reasons


def test_a_rank_error_keeps_its_rank_type_and_traceback(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    error = _rank_error(sessions, tmp_path)
    assert (error.type, error.rank) == ("RuntimeError", 1), error
    assert error.message == "injected fault at step 2", error
    assert error.traceback is not None and "raise RuntimeError" in error.traceback, error.traceback


@pytest.mark.parametrize(
    ("error_type", "retried"),
    [
        # What a command's program raised: a bug that a restart would only raise again.
        *(
            (t, False)
            for t in ("AssertionError", "SyntaxError", "IndentationError", "ImportError", "KeyError")
        ),
        # An exit code or a signal says nothing of why; a lost peer or an OOM need not repeat.
        *((t, True) for t in ("ProcessExited", "ProcessKilled", "RuntimeError", "OutOfMemoryError")),
    ],
)
def test_the_retry_rule_is_the_error_type(error_type: str, retried: bool) -> None:
    assert is_retryable(JobError(type=error_type, message="m", rank=1)) is retried
