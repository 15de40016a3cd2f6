"""Restarts on real ranks and real PostgreSQL: a killed rank resumes bitwise, the budget ends in `failed`."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from rank_contract.layout import JobFiles
from service.config import Settings
from service.jobs.metrics_repository import metric_series
from service.models import Checkpoint, Job
from tests.conftest import job_spec
from tests.engine_fixtures import assert_bitwise_equal
from tests.workers.runs import job_row, node_fixtures, run_attempt, submit_as_admin, timeline
from workers.attempt.node_run import RunPaths
from workers.engine.checkpoint import checkpoint_name, read_best_step
from workers.engine.events import StartedEvent, parse_event
from workers.sandbox.procs import rank_processes

STEPS = 24
# Evaluating every 4 steps, keeping the best checkpoint: the mark must survive the kill.
KEEP_BEST: dict[str, Any] = {
    "evaluation": {"every_steps": 4, "max_batches": 1},
    "checkpoint": {"every_steps": 4, "keep_last": 10, "keep_best": {"metric": "eval/loss", "mode": "min"}},
}


settings, sessions = node_fixtures()


def _submit(sessions: sessionmaker[Session], settings: Settings, **over: Any) -> str:
    spec = job_spec(
        name="restarts",
        hyperparameters={"global_batch_size": 8, "steps": STEPS, "hidden_size": 8, "momentum": 0.9},
        resources={"processes_per_node": 2},
        engine={"log_every_steps": 1},
        checkpoint={"every_steps": 4, "keep_last": 10},
    )
    spec.update(over)  # a section given here replaces the whole section
    return submit_as_admin(sessions, spec, settings=settings)


def _paths(settings: Settings, job_id: str, *, attempt: int) -> RunPaths:
    """Where the runner keeps node 0's files of an attempt (the runner's own layout)."""
    return RunPaths(JobFiles(settings.artifacts, job_id), attempt=attempt)


def _rank_pid(settings: Settings, job_id: str, rank: int) -> int:
    # A CPU rank is a fork of torchrun's agent: its command line and /proc environ are the agent's,
    # so the rank's own log line ("... rank R/W on cpu ... pid=P") says which process it is. P is its
    # pid in the sandbox's PID namespace: the host's process whose innermost pid (NSpid) it is.
    log = _paths(settings, job_id, attempt=1).run.folder / "logs" / f"rank{rank}.log"
    found = re.search(rf"rank {rank}/\d+ on .* pid=(\d+)", log.read_text() if log.exists() else "")
    for p in rank_processes(job_id) if found else []:
        if found and _innermost_pid(p.pid) == int(found.group(1)):
            return p.pid
    raise AssertionError(f"no rank {rank} process of job {job_id} found")


def _innermost_pid(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[-1]) for line in status.splitlines() if line.startswith("NSpid:")), None)


def _final_state(settings: Settings, job_id: str) -> dict[str, Any]:
    path = _paths(settings, job_id, attempt=1).job.checkpoints / checkpoint_name(STEPS)
    return dict(torch.load(path, weights_only=True))


@pytest.mark.e2e
def test_a_sigkilled_rank_resumes_from_its_checkpoint_and_ends_bitwise_equal(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slow steps (the math is unchanged), so the kill lands mid-run, after a checkpoint.
    monkeypatch.setenv("DPTRAIN_FAULT_INJECT", "sleep:ms=120")
    reference = _submit(sessions, settings, name="uninterrupted", **KEEP_BEST)
    assert run_attempt(job_id=reference, settings=settings) is JobStatus.SUCCEEDED

    job_id = _submit(sessions, settings, max_restarts=1, **KEEP_BEST)
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(run_attempt(job_id=job_id, settings=settings)))
    thread.start()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        with sessions() as s:
            saved = [c.step for c in s.query(Checkpoint).filter_by(job_id=job_id)]
        if saved and job_row(sessions, job_id).step >= 10:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the job never got past its first checkpoint")
    os.kill(_rank_pid(settings, job_id, 1), signal.SIGKILL)
    thread.join(timeout=60)
    assert out == [JobStatus.QUEUED], f"expected the attempt to end requeued, got {out}"
    assert job_row(sessions, job_id).queued_reason == "restarting: waiting for placement", (
        "placement restarts it"
    )
    assert rank_processes(job_id) == [], "no rank of the killed attempt may survive"
    pid_file = _paths(settings, job_id, attempt=1).run.pid
    assert pid_file.read_text().strip().isdigit(), "each attempt names its process group for operators"
    job = job_row(sessions, job_id)
    assert job.status == "queued" and job.claim_token is None and job.error is not None

    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED
    job = job_row(sessions, job_id)
    assert job.attempt == 2 and job.step == STEPS and job.error is None
    states = [s for s, _ in timeline(sessions, job_id)]
    assert states == ["queued", "running", "queued", "running", "succeeded"], states
    restart_reason = timeline(sessions, job_id)[2][1] or ""
    assert "restarting after attempt 1 of 2" in restart_reason, restart_reason
    lines = _paths(settings, job_id, attempt=2).run.rank_events(0).read_text()
    starts = [e.start_iter for e in map(parse_event, lines.splitlines()) if isinstance(e, StartedEvent)]
    assert starts and 0 not in starts, f"attempt 2 must resume from a checkpoint:\n{lines}"

    want, got = _final_state(settings, reference), _final_state(settings, job_id)
    for key in ("model", "optimizer", "iter", "world_size"):
        assert_bitwise_equal(want[key], got[key], key)

    # The best checkpoint is the lowest eval/loss's (the earliest of equals), as the engine's marker
    # says, and it is the one row marked best, across the kill.
    with sessions() as s:
        evals = metric_series(s, job_id=job_id, since_step=None, names=["eval/loss"])["eval/loss"]
        best_rows = [c.step for c in s.query(Checkpoint).filter_by(job_id=job_id) if c.best]
    lowest = min(evals, key=lambda p: (p[1], p[0]))[0]
    marker = read_best_step(_paths(settings, job_id, attempt=2).job.checkpoints)
    assert best_rows == [lowest] == [marker], f"best rows {best_rows}, marker {marker}, eval/loss {evals}"


@pytest.mark.e2e
def test_after_the_last_allowed_restart_the_job_fails_with_the_reason(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPTRAIN_FAULT_INJECT", "raise:rank=1:step=2")
    job_id = _submit(sessions, settings, max_restarts=1, hyperparameters={"global_batch_size": 8, "steps": 4})
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.QUEUED
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.FAILED, (
        "only the first failure restarts"
    )
    job = job_row(sessions, job_id)
    assert job.status == "failed" and job.attempt == 2
    assert "injected fault at step 2" in JobError.model_validate(job.error).message, job.error
    assert [s for s, _ in timeline(sessions, job_id)] == ["queued", "running", "queued", "running", "failed"]


@pytest.mark.e2e
def test_a_non_finite_loss_is_not_restarted(settings: Settings, sessions: sessionmaker[Session]) -> None:
    job_id = _submit(
        # An absurd learning rate overflows the loss within a few steps (as in tests/engine).
        sessions,
        settings,
        max_restarts=3,
        hyperparameters={"global_batch_size": 32, "steps": 50, "lr": 100.0, "momentum": 0.9},
    )
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.FAILED
    job = job_row(sessions, job_id)
    assert job.attempt == 1, "a resume would replay the same NaN bitwise: no restart"
    assert JobError.model_validate(job.error).type == "FloatingPointError", job.error


def test_a_job_whose_checkpoints_vanished_never_restarts_from_scratch(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    job_id = _submit(sessions, settings, max_restarts=2)
    with sessions.begin() as s:
        s.add(
            Checkpoint(
                job_id=job_id,
                attempt=1,
                step=8,
                path=f"/gone/{checkpoint_name(8)}",
                size_bytes=1,
                sha256="0" * 64,
            )
        )
        s.query(Job).filter_by(id=job_id).update({"attempt": 1})
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.FAILED
    job = job_row(sessions, job_id)
    assert JobError.model_validate(job.error).type == "CheckpointMissing", job.error
    assert not _paths(settings, job_id, attempt=2).run.rank_events(0).exists()
