"""One node of an attempt of a job: accept its placement, start its ranks, report, end it.

How the ranks are started, stopped and ended is a `Ranks`'s business (workers/attempt/ranks.py;
today torchrun on this host, in bubblewrap): the runner asks it and knows nothing of processes.

A multi-node attempt runs this on each of its nodes: torchrun's c10d rendezvous, hosted by node 0,
gathers them before any rank trains. Whichever node's ranks end the attempt records it (fenced by
the claim token); the other nodes see the job leave `running` at their next report and stop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from rank_contract.failures import Failure
from rank_contract.layout import JobFiles
from service.config import Settings
from service.db import session_factory
from service.scheduling import repository as placement
from workers.attempt import init_checkpoint
from workers.attempt.acceptance import Unrunnable, accept
from workers.attempt.checkpoint_cap import CheckpointGuard
from workers.attempt.checkpoint_rows import missing_checkpoints, sync_checkpoints
from workers.attempt.end import (
    WORKER_STOPPED,
    end_abnormally,
    end_cancelled,
    note_unsandboxed,
    record_outcome,
)
from workers.attempt.node_run import NodeRun, RunPaths
from workers.attempt.outputs import Guard, Limits
from workers.attempt.outputs import record as record_outputs
from workers.attempt.ranks import Launcher, LocalTorchrun, Ranks
from workers.attempt.watch import StopReason, Watch, stopping
from workers.pyenv import provision
from workers.pyenv.environments import Aborted, EnvironmentFailed
from workers.reporting.reporter import Reporter, final_flush
from workers.reporting.stack_watch import StackWatch
from workers.sandbox.procs import interface_of
from workers.sandbox.rank_setup import RankSetup, SetupFailed, prepare, take_back
from workers.sandbox.scratch import remove_earlier, remove_scratch

log = logging.getLogger(__name__)

FIRST_REPORT_POLL_SECONDS = 0.05
# (job, attempt) of the nodes this worker process runs right now, counted: the Celery pool's threads
# add and remove them, the reconciler of the same process reads them (`active()`). Keyed by attempt,
# because an ending attempt's thread and the next attempt's may overlap; counted, because a duplicate
# delivery's thread registers too (before its acceptance is refused) and must not unregister the run.
_ACTIVE: Counter[tuple[str, int]] = Counter()
_ACTIVE_LOCK = threading.Lock()


def active() -> frozenset[tuple[str, int]]:
    """The (job, attempt) pairs this worker process is running a node of."""
    with _ACTIVE_LOCK:
        return frozenset(k for k, n in _ACTIVE.items() if n > 0)


# Called when a node's run ends (slots are free again): the worker's placement thread sets it.
on_release: list[Callable[[], None]] = []


def run_node(
    *,
    job_id: str,
    attempt: int,
    node_rank: int,
    settings: Settings,
    endpoint: str = "",
    launcher: Launcher = LocalTorchrun,
) -> JobStatus | None:
    """Run node `node_rank` of `attempt` of a job to its end; None if the message was stale or a duplicate.

    `endpoint` is the rendezvous the start message carried; without one (a single-node job, or a
    message from before it was sent) it is read from the job's placement. `launcher` makes the
    object that starts, stops and ends the node's ranks (workers/attempt/ranks.py).

    Returns QUEUED when the attempt ended abnormally and the job was requeued for a restart.
    """
    # Registered before the acceptance commits, so this worker's reconciler never sees a node of the
    # job started here and not running unless its run really ended without recording its end.
    with _ACTIVE_LOCK:
        _ACTIVE[(job_id, attempt)] += 1
    try:
        return _run_node(
            job_id=job_id,
            attempt=attempt,
            node_rank=node_rank,
            settings=settings,
            endpoint=endpoint,
            launcher=launcher,
        )
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE[(job_id, attempt)] -= 1
            if _ACTIVE[(job_id, attempt)] <= 0:
                del _ACTIVE[(job_id, attempt)]
        for callback in on_release:
            callback()


def _run_node(
    *, job_id: str, attempt: int, node_rank: int, settings: Settings, endpoint: str, launcher: Launcher
) -> JobStatus | None:
    sessions = session_factory(settings)
    run = accept(
        sessions, job_id=job_id, attempt=attempt, node_rank=node_rank, settings=settings, endpoint=endpoint
    )
    if run is None:
        log.info(
            "job %s attempt %d node %d: not ours to start (stale or duplicate)", job_id, attempt, node_rank
        )
        return None
    paths = RunPaths(JobFiles(settings.artifacts, job_id), attempt, node_rank)
    try:
        if isinstance(run, Unrunnable):
            log.error("job %s: %s", job_id, run.error.message)
            return end_abnormally(sessions, att=run.att, error=run.error)
        ranks = launcher(settings=settings, run=run, paths=paths)
        return _supervise(sessions=sessions, settings=settings, run=run, paths=paths, ranks=ranks)
    except Exception as exc:
        log.exception("job %s: the launcher itself failed", job_id)
        error = JobError(type=Failure.LAUNCHER_ERROR, message=f"{type(exc).__name__}: {exc}")
        return end_abnormally(sessions, att=run.att, error=error)
    finally:
        # This node's ranks are gone: its slots are free for placement even if the others still run.
        try:
            with sessions.begin() as session:
                placement.release_node(session, job_id=job_id, attempt=attempt, worker=settings.node)
        except Exception:  # noqa: BLE001 - the attempt's end (or the reconciler) frees it anyway
            log.warning("job %s: releasing this node failed", job_id, exc_info=True)


def _supervise(
    *, sessions: sessionmaker[Session], settings: Settings, run: NodeRun, paths: RunPaths, ranks: Ranks
) -> JobStatus:
    att, spec = run.att, run.spec
    job_id = att.job_id
    # Before anything of this attempt is written: an earlier one's ranks must not write beside it.
    ranks.clear_earlier()
    # Scratch an earlier attempt here could not remove (its worker died first).
    remove_earlier(paths.job, attempt=att.number, node_rank=paths.node_rank)
    for folder in (paths.run.logs, paths.run.events):
        folder.mkdir(parents=True, exist_ok=True)
    paths.job.checkpoints.mkdir(parents=True, exist_ok=True)
    paths.job.outputs.mkdir(parents=True, exist_ok=True)
    if missing := missing_checkpoints(sessions, job_id=job_id, directory=paths.job.checkpoints):
        # Never restart silently from scratch: that would later prune the evidence (keep_last).
        error = JobError(type=Failure.CHECKPOINT_MISSING, message=missing)
        return end_abnormally(sessions, att=att, error=error)
    if att.number > 1 and run.is_primary:
        sync_checkpoints(sessions, att=att, directory=paths.job.checkpoints, attempt=max(1, att.number - 1))
    paths.write_spec(spec)
    # Closed last: the ranks' own uid (rank_setup.ranks_user) is leased until their processes are
    # gone and the attempt's files are the worker's again (take_back, in _prepare_and_launch, runs first).
    with contextlib.ExitStack() as uid_lease:
        return _prepare_and_launch(
            sessions=sessions, settings=settings, run=run, paths=paths, ranks=ranks, hold=uid_lease
        )


def _prepare_and_launch(
    *,
    sessions: sessionmaker[Session],
    settings: Settings,
    run: NodeRun,
    paths: RunPaths,
    ranks: Ranks,
    hold: contextlib.ExitStack,
) -> JobStatus:
    att, spec = run.att, run.spec
    try:
        setup = prepare(
            settings=settings,
            spec=spec,
            paths=paths,
            unsandboxed=ranks.unsandboxed(),
            hold=hold,
            multi_node=run.nnodes > 1,
            cluster_uid=run.cluster_uid,
            interface=interface_of(run.address) if run.rendezvous is not None else None,
            init=init_checkpoint.needed(run.init, checkpoint_dir=paths.job.checkpoints),
        )
    except SetupFailed as exc:
        remove_scratch(paths.run.folder)
        return end_abnormally(sessions, att=att, error=exc.error)
    if setup.unsandboxed is not None:
        note_unsandboxed(
            sessions, att=att, node=f"node {run.node_rank} ({settings.node})", why=setup.unsandboxed
        )
    try:
        # Holds the job's environment (if any) until its ranks are gone: eviction never removes it.
        with contextlib.ExitStack() as env_hold:
            return _launch(
                sessions=sessions,
                settings=settings,
                run=run,
                paths=paths,
                setup=setup,
                ranks=ranks,
                hold=env_hold,
            )
    finally:
        # Its ranks are gone (_launch killed what was left): only what they wrote on purpose stays.
        remove_scratch(paths.run.folder)
        if setup.run_as is not None:
            take_back(paths=paths, primary=run.is_primary)


def _launch(
    *,
    sessions: sessionmaker[Session],
    settings: Settings,
    run: NodeRun,
    paths: RunPaths,
    setup: RankSetup,
    ranks: Ranks,
    hold: contextlib.ExitStack,
) -> JobStatus:
    """Have the job's environment, start this node's ranks, watch them to their end, record the outcome."""
    spec, job_id = run.spec, run.att.job_id
    reporter = Reporter(
        sessions=sessions,
        job_id=job_id,
        attempt=paths.attempt,
        claim_token=run.att.token,
        run_dir=paths.run.folder,
        max_log_bytes=settings.max_log_bytes_per_job,
        max_metric_points=settings.max_metric_points_per_job,
        nodes=run.nnodes,
        checkpoint_dir=paths.job.checkpoints if run.is_primary else None,
    )
    max_runtime = spec.max_runtime_seconds
    deadline = time.monotonic() + max_runtime if max_runtime else None
    watch = Watch(
        stall_seconds=spec.stall_timeout_seconds,
        grace=settings.cancel_grace_seconds,
        stop_file=paths.run.stop if spec.command is not None else None,
    )
    limits = Limits(max_bytes=settings.max_output_bytes_per_job, max_files=settings.max_output_files_per_job)
    # Rank 0's node alone measures and records the outputs and the checkpoints (rank 0 writes them;
    # docs/code.md).
    guard = Guard(paths.job.outputs, limits) if run.is_primary else None
    cap = settings.max_checkpoint_bytes_per_job
    ckpt_guard = CheckpointGuard(paths.job.checkpoints, cap=cap) if run.is_primary else None
    try:
        setup = provision.enter(
            hold, sessions=sessions, settings=settings, run=run, paths=paths, setup=setup, reporter=reporter
        )
    except EnvironmentFailed as exc:
        final_flush(reporter, interval=settings.report_interval_seconds, job_id=job_id)
        return end_abnormally(sessions, att=run.att, error=exc.error)
    except Aborted:
        final_flush(reporter, interval=settings.report_interval_seconds, job_id=job_id)
        return _stopped_while_preparing(sessions, run=run, reporter=reporter)
    ranks.start(setup)
    try:
        _watch(
            ranks,
            settings=settings,
            reporter=reporter,
            watch=watch,
            deadline=deadline,
            job_id=job_id,
            guards=(guard, ckpt_guard),
        )
    finally:
        rc = ranks.end()
    final_flush(reporter, interval=settings.report_interval_seconds, job_id=job_id)
    if guard is not None and ckpt_guard is not None and watch.stopped_for is not StopReason.FENCED:
        # The ranks are gone: what the outputs and the checkpoint folder hold now is what this
        # attempt leaves, and the job's checkpoint list says so whatever events a kill cut short.
        _sync_at_end(sessions, run=run, paths=paths)
        over = record_outputs(
            sessions, job_id=job_id, attempt=paths.attempt, directory=paths.job.outputs, limits=limits
        )
        error = over or guard.error or ckpt_guard.at_end()
        if error is not None and not reporter.state.cancel_requested:
            return end_abnormally(sessions, att=run.att, error=error)
    return record_outcome(
        sessions,
        reporter=reporter,
        run=run,
        rc=rc,
        watch=watch,
        paths=paths,
        max_runtime=max_runtime,
    )


def _sync_at_end(sessions: sessionmaker[Session], *, run: NodeRun, paths: RunPaths) -> None:
    """Reconcile the job's checkpoint rows with its files once this attempt's ranks are gone."""
    try:
        sync_checkpoints(sessions, att=run.att, directory=paths.job.checkpoints, attempt=paths.attempt)
    except Exception:  # noqa: BLE001 - the end state matters more; the next attempt's start syncs too
        log.warning("job %s: reconciling its checkpoint rows failed", run.att.job_id, exc_info=True)


def _stopped_while_preparing(
    sessions: sessionmaker[Session], *, run: NodeRun, reporter: Reporter
) -> JobStatus:
    """Record the end of an attempt stopped before its ranks started (while its environment was had)."""
    att = run.att
    if reporter.state.fenced_out:
        return JobStatus.RUNNING
    if reporter.state.cancel_requested:
        return end_cancelled(sessions, att=att, finished=False)
    message = "its worker was stopped while it prepared the job's environment"
    return end_abnormally(sessions, att=att, error=JobError(type=WORKER_STOPPED, message=message))


def _watch(
    ranks: Ranks,
    *,
    settings: Settings,
    reporter: Reporter,
    watch: Watch,
    deadline: float | None,
    job_id: str,
    guards: tuple[Guard | None, CheckpointGuard | None],
) -> None:
    """Report what the ranks write while they run, and stop them when `watch` decides to."""
    stacks = StackWatch.of(reporter, node=settings.node)
    last_flush = time.monotonic()
    while ranks.poll() is None:
        # Until the first step is reported, look at the ranks' files often and report as soon
        # as something arrives: the time to the first step is what a user waits for. Later
        # reports batch on the regular tick.
        waiting = not reporter.state.latest_metrics
        time.sleep(FIRST_REPORT_POLL_SECONDS if waiting else settings.report_interval_seconds)
        if reporter.collect():
            watch.active()
        due = time.monotonic() - last_flush >= settings.report_interval_seconds
        if waiting and not due and not reporter.pending:
            continue
        if reporter.flush() and watch.stopped_for is None:
            stacks.after_report(reporter.state)
        last_flush = time.monotonic()
        if watch.stopped_for is None and (reason := _stop_reason(reporter, watch, deadline, guards)):
            stacks.before_stop(reporter.state, reason)  # a stall: where each rank hangs
            watch.stop(reason)
            log.info("job %s: stopping its ranks (%s)", job_id, reason)
        if watch.signal_due():
            ranks.stop(grace=watch.kill_after())


def _stop_reason(
    reporter: Reporter,
    watch: Watch,
    deadline: float | None,
    guards: tuple[Guard | None, CheckpointGuard | None],
) -> StopReason | None:
    """Why the ranks must stop now, if they must; the first reason that applies wins."""
    if reporter.state.cancel_requested:
        return StopReason.CANCEL
    if reporter.state.fenced_out:
        return StopReason.FENCED
    if stopping.is_set():
        return StopReason.SHUTDOWN
    if deadline is not None and time.monotonic() > deadline:
        return StopReason.DEADLINE
    if watch.stalled():
        return StopReason.STALL
    outputs, checkpoints = guards
    if outputs is not None and outputs.over():
        return StopReason.OUTPUTS
    if checkpoints is not None and checkpoints.over():
        return StopReason.CHECKPOINTS
    return None
