"""How an attempt ends: the end state recorded through outages, restarts within the job's budget."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from rank_contract.files import read_file
from service.jobs import lifecycle
from workers.attempt.node_run import Attempt, NodeRun, RunPaths
from workers.engine.events import TRACEBACK_TAIL_LINES
from workers.reporting.rank_text import escape_strings, escape_text

if TYPE_CHECKING:
    from workers.attempt.watch import Watch
    from workers.reporting.reporter import Reporter

log = logging.getLogger(__name__)

# How long the end state of an attempt is retried through a database outage. Past it the job stays
# `running` under this worker's name; this worker's reconciler, seeing it not in runner.active(), ends it.
FINISH_RETRY_SECONDS = 3600
# How much of the launcher log's end is read for the traceback of a failed launch.
_TAIL_BYTES = 64 << 10

# Errors a rank raises that a restart would only repeat: bugs in the training code or its spec, and
# a non-finite loss (resuming from the last checkpoint replays the same steps bitwise). Anything
# else -- a signal, a lost peer (Gloo/NCCL errors are RuntimeErrors), an OOM, a timeout, the
# launcher itself -- is retried while the job has restarts left. Names are class names, as the
# engine and a command's rank report them (workers/command/failure.py): a subclass is listed itself.
# See docs/reliability.md.
NOT_RETRIED = frozenset(
    {
        "FloatingPointError",
        "ValueError",
        # pydantic's, for a spec.json its JobSpec refuses (a ValueError, but named as itself).
        "ValidationError",
        "TypeError",
        "KeyError",
        "IndexError",
        "AttributeError",
        "NameError",
        "UnboundLocalError",
        "ImportError",
        "ModuleNotFoundError",
        "SyntaxError",
        # A command's main file that does not compile (SyntaxError's own subclasses).
        "IndentationError",
        "TabError",
        "AssertionError",
        "NotImplementedError",
        "PermissionError",
        "CheckpointMissing",
        # The job's code archive is hostile, damaged or gone, or its command names no program.
        "UnsafeArchive",
        "CodeCorrupt",
        "CodeMissing",
        "CommandNotFound",
        "CommandNotExecutable",
        # engine.compile's backend cannot run on the worker (no C++ compiler, no Triton): a setup
        # fault that a restart would only meet again (workers/engine/compile.py).
        "CompileUnavailable",
        # A data path outside the data root (or no data root on the worker); a sample the plan's
        # dataset cannot read for a reason other than I/O (DataReadError, an OSError's, is retried).
        "DataPathError",
        "DataLoadError",
        # A loader process raised outside a sample's read (workers/engine/loader_faults.py): the rank
        # reports the loader's own exception type, judged here like the rank's own. A batch that
        # pickle refuses (PicklingError; TypeError, AttributeError above) is refused again by the same
        # code. LoaderProcessDied (a signal: the OOM killer, a kill from outside) and LoaderTimeout (a
        # loader stuck, most often on a read from network storage) are retried: they need not repeat.
        "PicklingError",
        # The job's DPTRAIN_OUTPUT_DIR is over its limits (workers/attempt/outputs.py): the same script
        # writes the same outputs again.
        "OutputTooLarge",
        # Its checkpoint folder is over DPTRAIN_MAX_CHECKPOINT_BYTES_PER_JOB
        # (workers/attempt/checkpoint_cap.py): the same saves fill it again.
        "CheckpointTooLarge",
        # The job's init_from checkpoint is gone or not the bytes recorded at submit
        # (workers/attempt/init_checkpoint.py): a restart reads the same file.
        "InitCheckpointMismatch",
        "InitCheckpointMissing",
        # The job's environment cannot be built (the resolver's refusal, a missing package, the index
        # unreachable past the build's timeout) or its requirements file is not in the code
        # (workers/pyenv/environments.py): the same requirements meet the same index again.
        "EnvironmentBuildFailed",
        "RequirementsFileMissing",
        # The build wrote past DPTRAIN_MAX_ENV_BYTES: the same requirements write as much again.
        "EnvironmentTooLarge",
    }
)


# The end of an attempt whose worker was told to stop (workers/attempt/watch.py). Not the job's doing, so
# not charged to it: the job is requeued whatever its restart budget, and the budget grows by one,
# so that it keeps every restart it was given for its own failures (an evicted pod is not a failed
# one either). The crash of a worker stays a WorkerLost, charged: nobody can tell it from a fault
# the job itself provoked (an OOM kill of the whole host, say).
WORKER_STOPPED = "WorkerStopped"


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
        kind, message = "RendezvousFailed", "the nodes did not all join the rendezvous in time"
    elif rc:
        kind, message = "ProcessExited", f"rank processes exited with code {rc}"
    else:
        kind, message = "ProcessExited", "ranks exited without finishing"
    return JobError(type=kind, message=message, traceback=tail)


def _tail(path: Path, lines: int = TRACEBACK_TAIL_LINES) -> str | None:
    # The ranks may have put a link or a FIFO in the launcher log's place: read within a bound, never
    # through a link (rank_contract.files).
    data = read_file(path, limit=_TAIL_BYTES, from_end=True)
    if data is None:
        return None
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


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
    if stopped_for == "fenced":
        return JobStatus.RUNNING  # a newer attempt owns the job, or another node ended this one
    # A command's exit codes decide (torchrun exits 0 only when every rank did); the engine also
    # says it finished, so a rank that exits 0 early is not mistaken for success.
    done = reporter.state.finished or (run.spec.command is not None and run.is_primary)
    if stopped_for == "cancel" or reporter.state.cancel_requested:
        if not run.is_primary:
            return JobStatus.RUNNING  # node 0 sees the flag too, and alone knows if the work finished
        # The engine finished before the stop (which may then have signalled ranks on their way out),
        # or the ranks exited 0 on their own: the work was done first.
        finished = reporter.state.finished or (stopped_for is None and rc == 0 and done)
        with sessions() as session:
            pruned = lifecycle.prune_requested(session, job_id=job_id)
        dst, reason = lifecycle.end_of_cancelled_run(finished=finished, pruned=pruned)
        finish(sessions, job_id=job_id, token=token, dst=dst, reason=reason)
        return dst
    if stopped_for == "deadline" and reporter.state.finished:
        # As with a cancel: the work finished (every step, the final checkpoint) before the stop.
        reason = "finished before the deadline took effect"
        finish(sessions, job_id=job_id, token=token, dst=JobStatus.SUCCEEDED, reason=reason)
        return JobStatus.SUCCEEDED
    if stopped_for == "deadline":
        error = JobError(type="DeadlineExceeded", message=f"deadline exceeded ({max_runtime} s)")
        finish(sessions, job_id=job_id, token=token, dst=JobStatus.FAILED, error=error)
        return JobStatus.FAILED
    if stopped_for == "stall":
        message = f"no progress for {watch.stall_seconds:g} s: no rank reported a step or wrote a log line"
        if reporter.state.stacks_summary:
            message = f"{message}; {reporter.state.stacks_summary}"
        return end_abnormally(sessions, att=att, error=JobError(type="Stalled", message=message))
    if rc == 0 and done:
        finish(sessions, job_id=job_id, token=token, dst=JobStatus.SUCCEEDED)
        return JobStatus.SUCCEEDED
    if rc == 0 and run.nnodes > 1:
        # Rank 0, whose node records the success, may run on another node: nothing to record here.
        return JobStatus.RUNNING
    if stopped_for == "shutdown":
        message = "its worker was stopped; the job resumes from its last checkpoint"
        return end_abnormally(sessions, att=att, error=JobError(type=WORKER_STOPPED, message=message))
    started = reporter.state.started
    error = reporter.root_error() or launcher_error(paths.run.launcher_log, rc=rc, started=started)
    if reporter.state.stacks_summary:
        # Where the other ranks were when a collective timed out (workers/reporting/stack_watch.py).
        error = error.model_copy(update={"message": f"{error.message}; {reporter.state.stacks_summary}"})
    return end_abnormally(sessions, att=att, error=error)
