"""`init_from` on real ranks: a continuation ends bitwise equal, a fine-tune takes the weights alone,
a pinned file that does not verify fails the attempt unretried, before any rank starts."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from rank_contract.layout import JobFiles
from service.auth.tokens import ensure_bootstrap_admin
from service.config import Settings
from service.jobs import service
from service.models import Checkpoint
from tests.api_fixtures import ADMIN_TOKEN
from tests.conftest import job_spec
from tests.engine_fixtures import assert_bitwise_equal
from tests.workers.runs import job_row, node_fixtures, run_attempt, run_in_thread, submit_as_admin
from workers.attempt.node_run import RunPaths
from workers.engine.checkpoint import checkpoint_name
from workers.engine.events import StartedEvent, parse_event

pytestmark = pytest.mark.e2e

STEPS = 40
# Evaluated and checkpointed every 20 steps, the best kept: the source of the fine-tune has a best.
SPEC = job_spec(
    name="to-continue",
    hyperparameters={"global_batch_size": 8, "steps": STEPS, "hidden_size": 8, "momentum": 0.9},
    resources={"processes_per_node": 2},
    engine={"log_every_steps": 1},
    evaluation={"every_steps": 20, "max_batches": 1},
    checkpoint={"every_steps": 20, "keep_last": 5, "keep_best": {"metric": "eval/loss", "mode": "min"}},
)

settings, sessions = node_fixtures()


def _paths(settings: Settings, job_id: str, attempt: int = 1) -> RunPaths:
    return RunPaths(JobFiles(settings.artifacts, job_id), attempt=attempt)


def _state(settings: Settings, job_id: str, step: int) -> dict[str, Any]:
    path = _paths(settings, job_id).job.checkpoints / checkpoint_name(step)
    return dict(torch.load(path, weights_only=True))


def _start_iters(settings: Settings, job_id: str) -> list[int]:
    lines = _paths(settings, job_id).run.rank_events(0).read_text().splitlines()
    return [e.start_iter for e in map(parse_event, lines) if isinstance(e, StartedEvent)]


def _steps(sessions: sessionmaker[Session], job_id: str) -> list[int]:
    with sessions() as s:
        return sorted(c.step for c in s.query(Checkpoint).filter_by(job_id=job_id))


@pytest.fixture(scope="module")
def reference(settings: Settings, sessions: sessionmaker[Session]) -> str:
    """The uninterrupted 40-step job."""
    job_id = submit_as_admin(sessions, SPEC, settings=settings)
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED
    assert _steps(sessions, job_id) == [20, 40]
    return job_id


def test_a_job_continued_from_step_20_of_a_cancelled_one_ends_bitwise_equal_to_the_uninterrupted(
    settings: Settings, sessions: sessionmaker[Session], reference: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same 40-step spec, its steps slowed (the math is unchanged) so that the cancel lands after
    # its step-20 checkpoint and well before step 40.
    monkeypatch.setenv("DPTRAIN_FAULT_INJECT", "sleep:ms=150")
    source = submit_as_admin(sessions, SPEC, settings=settings)
    thread, out = run_in_thread(settings, source)
    deadline = time.monotonic() + 90
    while 20 not in _steps(sessions, source):
        assert time.monotonic() < deadline, "the source never saved its step-20 checkpoint"
        time.sleep(0.1)
    with sessions.begin() as s:
        service.cancel(s, user=ensure_bootstrap_admin(s, token=ADMIN_TOKEN), job_id=source)
    thread.join(timeout=60)
    assert out == [JobStatus.CANCELLED], out
    assert _steps(sessions, source) == [20], "cancelled between its two checkpoints"
    monkeypatch.delenv("DPTRAIN_FAULT_INJECT")

    # What `dptrain continue` submits: the spec again, init_from its newest checkpoint, resumed.
    continued = submit_as_admin(
        sessions, {**SPEC, "init_from": {"job": source, "resume": True}}, settings=settings
    )
    row = job_row(sessions, continued)
    with sessions() as s:
        sha = s.query(Checkpoint).filter_by(job_id=source, step=20).one().sha256
    assert (row.init_job, row.init_step, row.init_sha256) == (source, 20, sha)
    # The source's files may go: the continuation's pinned link keeps the checkpoint.
    shutil.rmtree(settings.artifacts / "jobs" / source)

    assert run_attempt(job_id=continued, settings=settings) is JobStatus.SUCCEEDED
    assert _start_iters(settings, continued) == [20], "its steps count on from the source's 20"
    want, got = _state(settings, reference, STEPS), _state(settings, continued, STEPS)
    for key in ("model", "optimizer", "iter", "world_size", "rng"):
        assert_bitwise_equal(want[key], got[key], key)


def test_a_fine_tune_takes_the_best_checkpoints_weights_with_a_fresh_optimizer_and_iter(
    settings: Settings, sessions: sessionmaker[Session], reference: str
) -> None:
    with sessions() as s:
        best = s.query(Checkpoint).filter_by(job_id=reference, best=True).one().step
    tune = job_spec(
        name="fine-tune",
        # Another seed and a tiny learning rate: four steps stay close to the weights they start from.
        hyperparameters={"global_batch_size": 8, "steps": 4, "hidden_size": 8, "lr": 1e-4, "seed": 7},
        resources={"processes_per_node": 2},
        checkpoint={"every_steps": 4},
        init_from={"job": reference, "best": True},
    )
    job_id = submit_as_admin(sessions, tune, settings=settings)
    assert job_row(sessions, job_id).init_step == best
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED
    assert _start_iters(settings, job_id) == [0], "ITER starts fresh"
    got, source = _state(settings, job_id, 4), _state(settings, reference, best)
    assert got["iter"] == 4
    # The optimizer is the fine-tune's own: a loaded one would carry the source's lr (0.05).
    assert [g["lr"] for g in got["optimizer"]["param_groups"]] == [1e-4]
    for name, weights in source["model"].items():
        moved = (got["model"][name] - weights).abs().max().item()
        assert moved <= 1e-2, f"{name}: {moved:.3g} from the best checkpoint's weights: not started from them"
    log = (_paths(settings, job_id).run.folder / "logs" / "rank0.log").read_text()
    assert "fine-tuning: model weights only" in log, log
    if os.getuid() == 0:
        # A root worker hands the pinned folder to the ranks' user: first made a copy of its own, so
        # the source's file (the same inode until then) stays the worker's.
        pinned = Path(str(job_row(sessions, job_id).init_path))
        original = _paths(settings, reference).job.checkpoints / checkpoint_name(best)
        assert not os.path.samefile(pinned, original) and original.stat().st_uid == 0


def test_a_pinned_file_that_does_not_verify_fails_the_attempt_unretried_before_any_rank(
    settings: Settings, sessions: sessionmaker[Session], reference: str
) -> None:
    spec = {**SPEC, "max_restarts": 2, "init_from": {"job": reference, "step": 20, "resume": True}}
    job_id = submit_as_admin(sessions, spec, settings=settings)
    pinned = Path(str(job_row(sessions, job_id).init_path))
    # Replaced, not rewritten in place: the source's file (the same inode until now) stays intact.
    damaged = bytearray(pinned.read_bytes())
    damaged[-1] ^= 0xFF
    swap = pinned.with_name("swap")
    swap.write_bytes(bytes(damaged))
    os.replace(swap, pinned)

    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.FAILED
    job = job_row(sessions, job_id)
    error = JobError.model_validate(job.error)
    assert job.attempt == 1, "a restart would read the same file: not retried"
    assert error.type == "InitCheckpointMismatch", error
    assert f"job {reference}, step 20" in error.message and "recorded at submit" in error.message, error
    assert not _paths(settings, job_id).run.rank_events(0).exists(), "no rank started"
