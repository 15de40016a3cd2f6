"""The node runner on real rank processes and real PostgreSQL: acceptance, failures, cancel, deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from service.auth.tokens import ensure_bootstrap_admin
from service.config import Settings
from service.jobs import service
from service.models import Job
from tests.api_fixtures import ADMIN_TOKEN
from tests.conftest import job_spec
from tests.workers.runs import (
    job_row,
    node_fixtures,
    place_here,
    run_attempt,
    run_in_thread,
    statuses,
    submit_as_admin,
    wait_step,
)
from workers.attempt import runner
from workers.attempt.runner import run_node
from workers.engine.checkpoint import checkpoint_files
from workers.sandbox.procs import rank_processes

settings, sessions = node_fixtures()


def _submit(sessions: sessionmaker[Session], settings: Settings, **over: Any) -> str:
    spec = job_spec(
        name="runner",
        hyperparameters={"global_batch_size": 8, "steps": 4, "hidden_size": 8},
        resources={"processes_per_node": 2},
        checkpoint={"every_steps": 2},
    )
    spec.update(over)  # a section given here replaces the whole section
    return submit_as_admin(sessions, spec, settings=settings)


@pytest.mark.e2e
def test_concurrent_duplicate_deliveries_run_the_job_once(settings: Settings, sessions: sessionmaker) -> None:
    job_id = _submit(sessions, settings)
    attempt = place_here(settings, job_id=job_id)
    results: list[JobStatus | None] = []

    def deliver() -> None:
        results.append(run_node(job_id=job_id, attempt=attempt, node_rank=0, settings=settings))

    threads = [threading.Thread(target=deliver) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert sorted(results, key=str) == sorted([JobStatus.SUCCEEDED, None], key=str), results
    job = job_row(sessions, job_id)
    assert job.status == "succeeded" and job.attempt == 1 and job.step == 4
    assert statuses(sessions, job_id) == ["queued", "running", "succeeded"]
    assert run_attempt(job_id=job_id, settings=settings) is None, "a late redelivery must not run again"


@pytest.mark.e2e
def test_a_rank_that_raises_fails_the_job_with_its_rank_and_traceback(
    settings: Settings, sessions: sessionmaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = _submit(sessions, settings)
    monkeypatch.setenv("DPTRAIN_FAULT_INJECT", "raise:rank=1:step=2")
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.FAILED
    job = job_row(sessions, job_id)
    assert job.status == "failed"
    assert job.error is not None, "a failed job says why"
    error = JobError.model_validate(job.error)
    assert error.rank == 1, f"expected the failing rank 1, got {job.error}"
    assert error.type == "RuntimeError" and "injected fault at step 2" in error.message, error
    assert "injected fault" in (error.traceback or ""), error
    assert rank_processes(job_id) == [], "no rank process may be left behind"


def test_a_failing_launcher_fails_the_job_with_a_launcher_error(
    settings: Settings, sessions: sessionmaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(**_: Any) -> JobStatus:
        raise OSError("no space left for spec.json")

    monkeypatch.setattr(runner, "_supervise", broken)
    job_id = _submit(sessions, settings)
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.FAILED
    error = JobError.model_validate(job_row(sessions, job_id).error)
    assert error == JobError(type="LauncherError", message="OSError: no space left for spec.json"), error


def test_a_stored_spec_that_no_longer_validates_fails_the_attempt_unretried(
    settings: Settings, sessions: sessionmaker
) -> None:
    # Written by an older version, or by hand: the worker refuses it with the reason, once, and
    # neither crashes nor starts torchrun nor restarts it (the same spec would fail again).
    job_id = _submit(sessions, settings, max_restarts=3)
    attempt = place_here(settings, job_id=job_id)
    with sessions.begin() as s:
        job = s.get(Job, job_id)
        job.spec = {**job.spec, "hyperparameters": {**job.spec["hyperparameters"], "steps": 0}}
    assert run_node(job_id=job_id, attempt=attempt, node_rank=0, settings=settings) is JobStatus.FAILED
    job = job_row(sessions, job_id)
    error = JobError.model_validate(job.error)
    assert error.type == "ValidationError", error
    assert "hyperparameters.steps" in error.message, f"the error names the field: {error.message}"
    assert job.status == "failed" and job.attempt == 1, (job.status, job.attempt)
    assert not (settings.artifacts / "jobs" / job_id / f"attempt-{attempt}").exists(), "nothing ran"


@pytest.mark.e2e
def test_cancel_stops_every_rank_of_a_running_job(settings: Settings, sessions: sessionmaker) -> None:
    job_id = _submit(sessions, settings, hyperparameters={"global_batch_size": 8, "steps": 10_000_000})
    thread, out = run_in_thread(settings, job_id)
    wait_step(sessions, job_id, 2)
    assert len(rank_processes(job_id)) >= 2, "both ranks run with the job id on their command line"
    with sessions.begin() as s:
        admin = ensure_bootstrap_admin(s, token=ADMIN_TOKEN)
        service.cancel(s, user=admin, job_id=job_id)
    asked = time.monotonic()
    while rank_processes(job_id) and time.monotonic() - asked < 10:
        time.sleep(0.1)
    assert rank_processes(job_id) == [], "every rank process must be gone within 10 s of the cancel"
    thread.join(timeout=60)
    assert out == [JobStatus.CANCELLED]
    assert job_row(sessions, job_id).status == "cancelled"


def test_a_cancelled_queued_job_never_starts(settings: Settings, sessions: sessionmaker) -> None:
    job_id = _submit(sessions, settings)
    with sessions.begin() as s:
        admin = ensure_bootstrap_admin(s, token=ADMIN_TOKEN)
        service.cancel(s, user=admin, job_id=job_id)
    assert run_attempt(job_id=job_id, settings=settings) is None, "its message, delivered late, runs nothing"
    job = job_row(sessions, job_id)
    assert job.status == "cancelled" and job.attempt == 0 and job.started_at is None


@pytest.mark.e2e
def test_max_runtime_ends_the_job_as_failed(settings: Settings, sessions: sessionmaker) -> None:
    job_id = _submit(
        sessions,
        settings,
        hyperparameters={"global_batch_size": 8, "steps": 10_000_000},
        max_runtime_seconds=2,
    )
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.FAILED
    job = job_row(sessions, job_id)
    error = JobError.model_validate(job.error)
    assert error.type == "DeadlineExceeded" and "deadline exceeded" in error.message, error
    assert rank_processes(job_id) == []


@pytest.mark.e2e
def test_outputs_are_written_under_the_artifact_root(settings: Settings, sessions: sessionmaker) -> None:
    job_id = _submit(sessions, settings)
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED
    job_dir = Path(settings.artifacts) / "jobs" / job_id
    assert list(checkpoint_files(job_dir / "checkpoints")) == [2, 4]
    assert (job_dir / "attempt-1" / "node-0" / "logs" / "rank1.log").is_file()


@pytest.mark.e2e
def test_a_rank_stuck_outside_a_collective_fails_the_job_after_the_timeout(
    settings: Settings, sessions: sessionmaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPTRAIN_FAULT_INJECT", "hang:rank=1:step=2")
    job_id = _submit(sessions, settings, engine={"collective_timeout_seconds": 5})
    thread, out = run_in_thread(settings, job_id)
    thread.join(timeout=120)
    assert not thread.is_alive(), "a stuck rank must end the job, not hang it"
    assert out == [JobStatus.FAILED]
    error = JobError.model_validate(job_row(sessions, job_id).error)
    assert error.type == "CollectiveTimeout" and error.rank is not None, error
    assert "collective_timeout_seconds" in error.message, error
    assert rank_processes(job_id) == [], "the stuck rank must be killed too"


@pytest.mark.e2e
def test_an_engine_job_that_makes_no_progress_ends_after_its_stall_timeout(
    settings: Settings, sessions: sessionmaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 hangs and rank 0 waits in its collective, silent, well within the collective timeout:
    # only the stall watchdog ends it.
    monkeypatch.setenv("DPTRAIN_FAULT_INJECT", "hang:rank=1:step=2")
    job_id = _submit(sessions, settings, engine={"collective_timeout_seconds": 600}, stall_timeout_seconds=10)
    thread, out = run_in_thread(settings, job_id)
    thread.join(timeout=120)
    assert not thread.is_alive() and out == [JobStatus.FAILED], out
    error = JobError.model_validate(job_row(sessions, job_id).error)
    assert error.type == "Stalled" and "no progress for 10 s" in error.message, error
    # Where each rank hung, read from outside the sandbox (workers/reporting/stacks.py): a forked engine rank
    # is named by its process name, and the hang is dptrain's own fault injection.
    assert "; rank 0 in " in error.message and "; rank 1 in Fault.maybe_fire (faults.py:" in error.message, (
        error
    )
    assert rank_processes(job_id) == [], "every rank is killed"


@pytest.mark.e2e
def test_the_end_of_a_run_frees_its_node_and_kicks_placement(
    settings: Settings, sessions: sessionmaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy import func, select

    from service.models import JobNode
    from workers.attempt import runner

    kicks: list[int] = []
    monkeypatch.setattr(runner, "on_release", [lambda: kicks.append(1)])
    job_id = _submit(sessions, settings)
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED
    with sessions() as s:
        held = s.execute(select(func.count()).select_from(JobNode).where(JobNode.job_id == job_id)).scalar()
    assert held == 0, "the job's slots are free again"
    assert kicks == [1], "placement is asked to use them"


@pytest.mark.e2e
def test_a_rendezvous_that_never_completes_ends_the_attempt_and_frees_every_node(
    settings: Settings, sessions: sessionmaker, free_port: Callable[[], int]
) -> None:
    from sqlalchemy import func, select

    from service.jobs import lifecycle
    from service.models import JobNode
    from service.models.base import utcnow
    from service.scheduling import repository as placement

    job_id = _submit(sessions, settings, resources={"nodes": 2, "processes_per_node": 1})
    with sessions.begin() as s:
        job = lifecycle.claim(s, job_id=job_id, worker=settings.node)
        assert job is not None
        rows = [
            {"node_rank": 0, "worker": settings.node, "port": free_port()},
            {"node_rank": 1, "worker": "ghost", "port": None},  # its worker never starts its part
        ]
        placement.add_nodes(
            s,
            rows=[
                {
                    **r,
                    "job_id": job_id,
                    "attempt": 1,
                    "slots": 1,
                    "address": "127.0.0.1",
                    "placed_at": utcnow(),
                }
                for r in rows
            ],
        )
    quick = settings.model_copy(update={"rendezvous_timeout_seconds": 3})
    started = time.monotonic()
    assert run_node(job_id=job_id, attempt=1, node_rank=0, settings=quick) is JobStatus.FAILED
    assert time.monotonic() - started < 90, "bounded by the rendezvous timeout, not the collective one"
    error = JobError.model_validate(job_row(sessions, job_id).error)
    assert error.type == "RendezvousFailed" and error.rank is None, error
    with sessions() as s:
        held = s.execute(select(func.count()).select_from(JobNode).where(JobNode.job_id == job_id)).scalar()
    assert held == 0, "every node of the attempt is free again"
    assert rank_processes(job_id) == []
