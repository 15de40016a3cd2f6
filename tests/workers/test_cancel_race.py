"""A cancel (or the deadline) racing the end of a run: work that finished first is `succeeded`.

In the test's process, without ranks: the run's event file is written as rank 0 writes it, the cancel
is requested through the jobs service, and the runner's reporter and end decision run as after torchrun
exits. Real ranks cannot be stopped at the exact moment between the finished event and their exit.
"""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobSpec, JobStatus
from rank_contract.layout import JobFiles
from service.auth.tokens import ensure_bootstrap_admin
from service.config import Settings
from service.jobs import service
from tests.api_fixtures import ADMIN_TOKEN
from tests.conftest import job_spec
from tests.workers.runs import job_row, node_fixtures, place_here, submit_as_admin, timeline
from workers.attempt import end, runner
from workers.attempt.node_run import Attempt, NodeRun, RunPaths
from workers.attempt.watch import StopReason, Watch
from workers.engine.events import CheckpointEvent, EventWriter, FinishedEvent, MetricsEvent, StartedEvent
from workers.reporting.reporter import Reporter

settings, sessions = node_fixtures()

STEPS = 4


def _end_after_stop(
    settings: Settings,
    sessions: sessionmaker[Session],
    *,
    last_step: int,
    finished: bool,
    node_rank: int = 0,
    stop: StopReason = StopReason.CANCEL,
) -> tuple[str, JobStatus]:
    """Run a job to `last_step` (checkpointed; `finished`: the engine said so), stop it, end it.

    `stop`: a cancel (requested through the service), or the job's deadline.
    """
    spec = job_spec(name="race", hyperparameters={"global_batch_size": 8, "steps": STEPS, "hidden_size": 8})
    job_id = submit_as_admin(sessions, spec, settings=settings)
    attempt = place_here(settings, job_id=job_id)
    paths = RunPaths(JobFiles(settings.artifacts, job_id), attempt, node_rank)
    events = EventWriter(paths.run.folder / "events" / "rank0.jsonl", rank=0)
    events.emit(StartedEvent(world_size=2, total_steps=STEPS, device="cpu", backend="gloo"))
    events.emit(MetricsEvent(step=last_step, values={"loss": 0.5}))
    events.emit(CheckpointEvent(step=last_step, size_bytes=1, sha256="0" * 64))
    if finished:
        events.emit(FinishedEvent(step=last_step))
    events.close()
    if stop is StopReason.CANCEL:
        with sessions.begin() as s:
            service.cancel(s, user=ensure_bootstrap_admin(s, token=ADMIN_TOKEN), job_id=job_id)
    job = job_row(sessions, job_id)
    att = Attempt(job_id=job_id, number=attempt, token=str(job.claim_token), max_restarts=0)
    reporter = Reporter(
        sessions=sessions, job_id=job_id, attempt=attempt, claim_token=att.token, run_dir=paths.run.folder
    )
    reporter.collect(final=True)
    cancelled = stop is StopReason.CANCEL
    assert reporter.flush() and reporter.state.cancel_requested == cancelled, "the runner reads it"
    # The runner saw the request (or the deadline) and signalled torchrun's group, whose ranks died of it.
    watch = Watch(stall_seconds=60, grace=1, stop_file=None)
    watch.stop(stop)
    run = NodeRun(
        att=att,
        node_rank=node_rank,
        nnodes=node_rank + 1,
        spec=JobSpec.model_validate(job.spec),
        rendezvous=None,
        address="",
    )
    status = end.record_outcome(
        sessions, reporter=reporter, run=run, rc=-15, watch=watch, paths=paths, max_runtime=60
    )
    return job_id, status


class TestCancelRace:
    def test_a_cancel_after_the_last_step_and_checkpoint_leaves_the_job_succeeded(
        self, settings: Settings, sessions: sessionmaker[Session]
    ) -> None:
        job_id, status = _end_after_stop(settings, sessions, last_step=STEPS, finished=True)
        job = job_row(sessions, job_id)
        assert (status, job.status) == (JobStatus.SUCCEEDED, "succeeded"), (status, job.status)
        assert job.cancel_requested, "the request stays visible: it came, too late to stop anything"
        assert job.step == STEPS and job.error is None, (job.step, job.error)
        assert timeline(sessions, job_id)[-1] == ("succeeded", "finished before the cancel took effect")

    def test_a_cancel_of_a_job_that_had_not_finished_leaves_it_cancelled(
        self, settings: Settings, sessions: sessionmaker[Session]
    ) -> None:
        # Every step ran and was checkpointed, but the engine had not said it finished: not done.
        job_id, status = _end_after_stop(settings, sessions, last_step=STEPS, finished=False)
        job = job_row(sessions, job_id)
        assert (status, job.status) == (JobStatus.CANCELLED, "cancelled"), (status, job.status)
        assert timeline(sessions, job_id)[-1] == ("cancelled", "cancel requested")

    @pytest.mark.parametrize("finished", [True, False])
    def test_only_node_0_records_the_end_of_a_cancelled_multi_node_job(
        self, settings: Settings, sessions: sessionmaker[Session], finished: bool
    ) -> None:
        # Another node cannot know whether rank 0 finished first; racing node 0's record would let a
        # `cancelled` win over a finished run.
        job_id, status = _end_after_stop(settings, sessions, last_step=2, finished=finished, node_rank=1)
        assert status is JobStatus.RUNNING and job_row(sessions, job_id).status == "running"

    @pytest.mark.parametrize("finished", [True, False])
    def test_a_deadline_after_the_work_finished_leaves_it_succeeded(
        self, settings: Settings, sessions: sessionmaker[Session], finished: bool
    ) -> None:
        job_id, status = _end_after_stop(
            settings, sessions, last_step=STEPS, finished=finished, stop=StopReason.DEADLINE
        )
        job = job_row(sessions, job_id)
        if finished:
            assert (status, job.status, job.error) == (JobStatus.SUCCEEDED, "succeeded", None), job.error
            assert timeline(sessions, job_id)[-1] == ("succeeded", "finished before the deadline took effect")
        else:
            assert (status, job.status) == (JobStatus.FAILED, "failed")
            assert job.error is not None and job.error["type"] == "DeadlineExceeded", job.error

    @pytest.mark.parametrize("node_rank", [0, 1])
    def test_a_cancel_while_the_environment_is_prepared_ends_the_job_the_same_way(
        self, settings: Settings, sessions: sessionmaker[Session], node_rank: int
    ) -> None:
        # No rank ever started: the one cancel path (end.end_cancelled) records it as not finished,
        # from whichever node was preparing (none of them has ranks that could have finished first).
        job_id = submit_as_admin(sessions, job_spec(name="prep"), settings=settings)
        attempt = place_here(settings, job_id=job_id)
        with sessions.begin() as s:
            service.cancel(s, user=ensure_bootstrap_admin(s, token=ADMIN_TOKEN), job_id=job_id)
        job = job_row(sessions, job_id)
        att = Attempt(job_id=job_id, number=attempt, token=str(job.claim_token), max_restarts=0)
        paths = RunPaths(JobFiles(settings.artifacts, job_id), attempt, node_rank)
        reporter = Reporter(
            sessions=sessions, job_id=job_id, attempt=attempt, claim_token=att.token, run_dir=paths.run.folder
        )
        assert reporter.flush() and reporter.state.cancel_requested, "the report loop reads the request"
        run = NodeRun(
            att=att,
            node_rank=node_rank,
            nnodes=2,
            spec=JobSpec.model_validate(job.spec),
            rendezvous=None,
            address="",
        )
        status = runner._stopped_while_preparing(sessions, run=run, reporter=reporter)
        assert (status, job_row(sessions, job_id).status) == (JobStatus.CANCELLED, "cancelled")
        assert timeline(sessions, job_id)[-1] == ("cancelled", "cancel requested")
