"""How an attempt ends: the end state recorded through outages, restarts within the job's budget."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from pickle import PicklingError
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from rank_contract.failures import Failure
from rank_contract.files import read_file
from service.jobs import lifecycle
from workers.attempt.node_run import Attempt, NodeRun, RunPaths
from workers.attempt.watch import StopReason, Watch
from workers.engine.events import TRACEBACK_TAIL_LINES
from workers.reporting.rank_text import escape_strings, escape_text

if TYPE_CHECKING:
    from workers.reporting.reporter import Reporter

log = logging.getLogger(__name__)

# How long the end state of an attempt is retried through a database outage. Past it the job stays
# `running` under this worker's name; this worker's reconciler, seeing it not in runner.active(), ends it.
FINISH_RETRY_SECONDS = 3600
# How much of the launcher log's end is read for the traceback of a failed launch.
_TAIL_BYTES = 64 << 10

# Exceptions that are not ours, which a rank's code raises and a restart would only raise again: bugs in
# the training code or its spec, and a non-finite loss (resuming from the last checkpoint replays the
# same steps bitwise). Named by their classes, as the engine and a command's rank report them
# (workers/command/failure.py): a subclass is listed itself. Our own failure types each say whether
# they are retried where they are declared (rank_contract/failures.py). Anything else -- a signal, a
# lost peer (Gloo/NCCL errors are RuntimeErrors), an OOM, a timeout, the launcher itself -- is retried
# while the job has restarts left. See docs/reliability.md.
_NOT_OURS_NOT_RETRIED: tuple[type[BaseException], ...] = (
    FloatingPointError,
    ValueError,
    # pydantic's, for a spec.json its JobSpec refuses (a ValueError, but named as itself).
    ValidationError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    NameError,
    UnboundLocalError,
    ImportError,
    ModuleNotFoundError,
    SyntaxError,
    # A command's main file that does not compile (SyntaxError's own subclasses).
    IndentationError,
    TabError,
    AssertionError,
    NotImplementedError,
    PermissionError,
    # A loader process raised outside a sample's read (workers/engine/loader_faults.py): the rank
    # reports the loader's own exception type, judged here like the rank's own. A batch that pickle
    # refuses (PicklingError; TypeError, AttributeError above) is refused again by the same code.
    PicklingError,
)
NOT_RETRIED: frozenset[str] = frozenset(
    {e.__name__ for e in _NOT_OURS_NOT_RETRIED}
    | {failure.value for failure in Failure if not failure.retried}
)


# The end of an attempt whose worker was told to stop (workers/attempt/watch.py). Not the job's doing, so
# not charged to it: the job is requeued whatever its restart budget, and the budget grows by one,
# so that it keeps every restart it was given for its own failures (an evicted pod is not a failed
# one either). The crash of a worker stays a WorkerLost, charged: nobody can tell it from a fault
# the job itself provoked (an OOM kill of the whole host, say).
WORKER_STOPPED = Failure.WORKER_STOPPED


def is_retryable(error: JobError) -> bool:
    """Whether an attempt that ended with `error` may be restarted (if the job has restarts left).

    The one rule, for every kind of job: by the error's type alone, retried unless NOT_RETRIED names
    it. A command job's type is the exception its program raised wherever it can be found (dptrain's
    start-up hook, torchrun's error file, the log), else ProcessExited (an exit code: retried, the
    program said nothing of why) or ProcessKilled (a signal: retried).
    """
    return error.type not in NOT_RETRIED


def end_abnormally(sessions: sessionmaker[Session], *, att: Attempt, error: JobError) -> JobStatus:
    """End a failed attempt: requeue the job while restarts remain (placement starts it again), else fail it.

    Both are conditional on the attempt's claim token, so only one of the attempt's nodes (or the
    reconciler that took its lease away) records it, once; leaving `running` frees all its nodes.
    """
    charged = error.type != WORKER_STOPPED
    if not charged or (is_retryable(error) and att.number <= att.max_restarts):
        why = f"{error.type}: {error.message}"
        reason = (
            f"restarting after attempt {att.number} of {att.max_restarts + 1}: {why}"
            if charged
            else f"requeued after attempt {att.number}, not counted as a restart: {why}"
        )
        values = {
            "claim_token": None,
            "worker": None,
            "step": lifecycle.resume_step(att.job_id),
            "queued_reason": "restarting: waiting for placement",
            # Fenced by the claim token like the rest: no other writer can have moved it meanwhile.
            **({} if charged else {"max_restarts": att.max_restarts + 1}),
        }
        finish(
            sessions,
            job_id=att.job_id,
            token=att.token,
            dst=JobStatus.QUEUED,
            error=error,
            reason=reason,
            values=values,
        )
        return JobStatus.QUEUED
    finish(sessions, job_id=att.job_id, token=att.token, dst=JobStatus.FAILED, error=error)
    return JobStatus.FAILED


def finish(
    sessions: sessionmaker[Session],
    *,
    job_id: str,
    token: str,
    dst: JobStatus,
    error: JobError | None = None,
    reason: str | None = None,
    values: dict[str, Any] | None = None,
) -> bool:
    """Record the end state, retrying while the database is unreachable (the outcome must not be lost).

    False if the attempt no longer owned the job (its lease was taken away): nothing is written.
    """
    # The one place a job's `error` column is written from (placement's claim only clears it). Its
    # text is a rank's (a message, a traceback, what torchrun's error file said): escaped, so that
    # the database takes it and a terminal shows it (workers/reporting/rank_text.py).
    values = {**(values or {}), **({"error": escape_strings(error.model_dump())} if error else {})}
    reason = reason or (error.message if error else None)
    reason = escape_text(reason, newlines=True) if reason is not None else None
    delay = 0.5
    give_up = time.monotonic() + FINISH_RETRY_SECONDS
    while True:
        try:
            with sessions.begin() as session:
                done = lifecycle.transition(
                    session,
                    job_id=job_id,
                    src=JobStatus.RUNNING,
                    dst=dst,
                    claim_token=token,
                    reason=reason,
                    values=values,
                )
            return done is not None
        except Exception:  # noqa: BLE001
            if time.monotonic() > give_up:
                raise RuntimeError(f"could not record the end state of job {job_id}") from None
            log.warning("job %s: recording %s failed; retrying", job_id, dst.value, exc_info=True)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def note_unsandboxed(sessions: sessionmaker[Session], *, att: Attempt, node: str, why: str) -> None:
    """Say in the job's timeline that `node` runs this attempt's ranks without the sandbox, and why."""
    try:
        with sessions.begin() as session:
            note = f"{node}: ranks not sandboxed ({why})"
            lifecycle.note_running(session, job_id=att.job_id, attempt=att.number, note=note)
    except Exception:  # noqa: BLE001 - the run itself does not depend on the note
        log.warning("job %s: noting the missing sandbox in its timeline failed", att.job_id, exc_info=True)


def launcher_error(log_path: Path, *, rc: int, started: bool) -> JobError:
    """The error of an attempt whose ranks reported none: torchrun's own failure, often the rendezvous."""
    tail = _tail(log_path)
    if not started and tail and "Rendezvous" in tail:
        kind, message = Failure.RENDEZVOUS_FAILED, "the nodes did not all join the rendezvous in time"
    elif rc:
        kind, message = Failure.PROCESS_EXITED, f"rank processes exited with code {rc}"
    else:
        kind, message = Failure.PROCESS_EXITED, "ranks exited without finishing"
    return JobError(type=kind, message=message, traceback=tail)


def _tail(path: Path, lines: int = TRACEBACK_TAIL_LINES) -> str | None:
    # The ranks may have put a link or a FIFO in the launcher log's place: read within a bound, never
    # through a link (rank_contract.files).
    data = read_file(path, limit=_TAIL_BYTES, from_end=True)
    if data is None:
        return None
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


def end_cancelled(sessions: sessionmaker[Session], *, att: Attempt, finished: bool) -> JobStatus:
    """End an attempt whose job was asked to stop: cancelled or pruned, succeeded if it `finished` first."""
    with sessions() as session:
        pruned = lifecycle.prune_requested(session, job_id=att.job_id)
    dst, reason = lifecycle.end_of_cancelled_run(finished=finished, pruned=pruned)
    finish(sessions, job_id=att.job_id, token=att.token, dst=dst, reason=reason)
    return dst


def record_outcome(
    sessions: sessionmaker[Session],
    *,
    reporter: Reporter,
    run: NodeRun,
    rc: int,
    watch: Watch,
    paths: RunPaths,
    max_runtime: int | None,
) -> JobStatus:
    """Record how a node's run ended, from how it was stopped, its exit code and what rank 0 reported."""
    att, stopped_for = run.att, watch.stopped_for
    job_id, token = att.job_id, att.token
    if stopped_for is StopReason.FENCED:
        return JobStatus.RUNNING  # a newer attempt owns the job, or another node ended this one
    # A command's exit codes decide (torchrun exits 0 only when every rank did); the engine also
    # says it finished, so a rank that exits 0 early is not mistaken for success.
    done = reporter.state.finished or (run.spec.command is not None and run.is_primary)
    if stopped_for is StopReason.CANCEL or reporter.state.cancel_requested:
        if not run.is_primary:
            return JobStatus.RUNNING  # node 0 sees the flag too, and alone knows if the work finished
        # The engine finished before the stop (which may then have signalled ranks on their way out),
        # or the ranks exited 0 on their own: the work was done first.
        finished = reporter.state.finished or (stopped_for is None and rc == 0 and done)
        return end_cancelled(sessions, att=att, finished=finished)
    if stopped_for is StopReason.DEADLINE and reporter.state.finished:
        # As with a cancel: the work finished (every step, the final checkpoint) before the stop.
        reason = "finished before the deadline took effect"
        finish(sessions, job_id=job_id, token=token, dst=JobStatus.SUCCEEDED, reason=reason)
        return JobStatus.SUCCEEDED
    if stopped_for is StopReason.DEADLINE:
        error = JobError(type=Failure.DEADLINE_EXCEEDED, message=f"deadline exceeded ({max_runtime} s)")
        finish(sessions, job_id=job_id, token=token, dst=JobStatus.FAILED, error=error)
        return JobStatus.FAILED
    if stopped_for is StopReason.STALL:
        message = f"no progress for {watch.stall_seconds:g} s: no rank reported a step or wrote a log line"
        if reporter.state.stacks_summary:
            message = f"{message}; {reporter.state.stacks_summary}"
        return end_abnormally(sessions, att=att, error=JobError(type=Failure.STALLED, message=message))
    if rc == 0 and done:
        finish(sessions, job_id=job_id, token=token, dst=JobStatus.SUCCEEDED)
        return JobStatus.SUCCEEDED
    if rc == 0 and run.nnodes > 1:
        # Rank 0, whose node records the success, may run on another node: nothing to record here.
        return JobStatus.RUNNING
    if stopped_for is StopReason.SHUTDOWN:
        message = "its worker was stopped; the job resumes from its last checkpoint"
        return end_abnormally(sessions, att=att, error=JobError(type=WORKER_STOPPED, message=message))
    started = reporter.state.started
    error = reporter.root_error() or launcher_error(paths.run.launcher_log, rc=rc, started=started)
    if reporter.state.stacks_summary:
        # Where the other ranks were when a collective timed out (workers/reporting/stack_watch.py).
        error = error.model_copy(update={"message": f"{error.message}; {reporter.state.stacks_summary}"})
    return end_abnormally(sessions, att=att, error=error)
