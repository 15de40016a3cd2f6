"""One attempt of a job: claim it, launch its ranks with torchrun, report, record the end state."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.config import Settings
from service.db import session_factory
from service.dispatch import Dispatcher
from service.jobs import lifecycle
from service.jobs import repository as jobs_repository
from service.models.base import utcnow
from workers.attempts import Attempt, end_abnormally, finish, release_deferred
from workers.engine.launch import SUPERVISOR_ENV, supervisor_id, torchrun_command
from workers.procs import kill_group, stop_group, sweep_ranks
from workers.reporting import Reporter

log = logging.getLogger(__name__)

TRACEBACK_TAIL_LINES = 40
FINAL_FLUSH_SECONDS = 300
# Jobs this worker process is running an attempt of right now (the Celery pool's threads add and
# remove them; the reconciler of the same process reads it).
ACTIVE: set[str] = set()


@dataclass(frozen=True)
class RunPaths:
    """Where an attempt keeps its files: checkpoints are per job, so a restart can resume from them."""

    job_dir: Path
    attempt: int

    @property
    def run_dir(self) -> Path:
        return self.job_dir / f"attempt-{self.attempt}"

    @property
    def checkpoint_dir(self) -> Path:
        return self.job_dir / "checkpoints"

    @property
    def spec_path(self) -> Path:
        return self.run_dir / "spec.json"

    @property
    def launcher_log(self) -> Path:
        return self.run_dir / "logs" / "launcher.log"

    @property
    def pid_file(self) -> Path:
        """torchrun's pid, which is also its process group id (it leads a session of its own)."""
        return self.run_dir / "torchrun.pid"


def worker_name() -> str:
    """This worker's name as recorded on the jobs it claims."""
    return f"{socket.gethostname()}:{os.getpid()}"


def run_attempt(*, job_id: str, settings: Settings, dispatcher: Dispatcher | None = None) -> JobStatus | None:
    """Run one attempt of `job_id` to its end; None if the job was not claimable (duplicate delivery).

    Returns QUEUED when the attempt ended abnormally and the job was requeued for a restart
    (republished through `dispatcher`, by default the Celery queue of the job's device).
    """
    # Registered before the claim commits, so this worker's reconciler never sees the job claimed
    # by us and not running here unless its attempt really ended without recording its end state.
    ACTIVE.add(job_id)
    try:
        return _run_attempt(job_id=job_id, settings=settings, dispatcher=dispatcher)
    finally:
        ACTIVE.discard(job_id)


def _run_attempt(*, job_id: str, settings: Settings, dispatcher: Dispatcher | None) -> JobStatus | None:
    sessions = session_factory(settings)
    with sessions.begin() as session:
        limit = settings.max_running_jobs_per_user
        job = lifecycle.claim(session, job_id=job_id, worker=worker_name(), max_running_per_user=limit)
        if job is None:
            log.info("job %s not claimable: a duplicate, cancelled, or its owner is at the limit", job_id)
            return None
        spec, owner = dict(job.spec), job.owner_id
        att = Attempt(
            job_id=job_id,
            number=job.attempt,
            token=str(job.claim_token),
            max_restarts=job.max_restarts,
            device=str(spec.get("resources", {}).get("device", "cpu")),
        )
    paths = RunPaths(settings.artifacts / "jobs" / job_id, att.number)
    try:
        return _supervise(
            sessions=sessions, settings=settings, att=att, spec=spec, paths=paths, dispatcher=dispatcher
        )
    except Exception as exc:
        log.exception("job %s: the launcher itself failed", job_id)
        error = {"type": "LauncherError", "message": f"{type(exc).__name__}: {exc}", "rank": None}
        return end_abnormally(sessions, settings=settings, att=att, error=error, dispatcher=dispatcher)
    finally:
        # The owner has one running job fewer: what the running-jobs limit held back may start now.
        release_deferred(sessions=sessions, settings=settings, owner_id=owner)


def _supervise(
    *,
    sessions: sessionmaker[Session],
    settings: Settings,
    att: Attempt,
    spec: dict[str, Any],
    paths: RunPaths,
    dispatcher: Dispatcher | None,
) -> JobStatus:
    job_id, token = att.job_id, att.token
    # Ranks of an earlier attempt of this job whose worker died (torchrun runs in a session of its
    # own, so a SIGKILLed worker leaves them running) must not write checkpoints beside ours.
    if left := sweep_ranks(job_id):
        log.warning("job %s: killed %d processes of an earlier attempt", job_id, left)
    for sub in ("logs", "events"):
        (paths.run_dir / sub).mkdir(parents=True, exist_ok=True)
    paths.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if missing := _missing_checkpoints(sessions, job_id=job_id, directory=paths.checkpoint_dir):
        # Never restart silently from scratch: that would later prune the evidence (keep_last).
        error = {"type": "CheckpointMissing", "message": missing, "rank": None}
        return end_abnormally(sessions, settings=settings, att=att, error=error, dispatcher=dispatcher)
    if att.number > 1:
        _sync_checkpoints(sessions, att=att, directory=paths.checkpoint_dir)
    paths.spec_path.write_text(json.dumps(spec, indent=2))
    cmd = torchrun_command(
        job_id=job_id,
        nproc=int(spec["resources"]["processes_per_node"]),
        spec_path=str(paths.spec_path),
        run_dir=str(paths.run_dir),
        checkpoint_dir=str(paths.checkpoint_dir),
    )
    # torchrun itself sets OMP_NUM_THREADS=1 when several ranks share a host, and leaves a single
    # rank free to use every core.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SUPERVISOR_ENV: supervisor_id()}
    reporter = Reporter(
        sessions=sessions, job_id=job_id, attempt=paths.attempt, claim_token=token, run_dir=paths.run_dir
    )
    max_runtime = spec.get("max_runtime_seconds")
    deadline = time.monotonic() + max_runtime if max_runtime else None
    with paths.launcher_log.open("ab") as launcher_out:
        # A session of its own: cancelling or cleaning up kills torchrun and every rank together.
        proc = subprocess.Popen(
            cmd, stdout=launcher_out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    # For operators (and a recovering worker on another machine's tooling): which group to kill.
    with contextlib.suppress(OSError):  # never a reason to lose track of the group just started
        paths.pid_file.write_text(f"{proc.pid}\n")
    stopped_for: str | None = None
    try:
        while proc.poll() is None:
            time.sleep(settings.report_interval_seconds)
            reporter.collect()
            reporter.flush()
            if stopped_for is None:
                if reporter.state.cancel_requested:
                    stopped_for = "cancel"
                elif reporter.state.fenced_out:
                    stopped_for = "fenced"
                elif deadline is not None and time.monotonic() > deadline:
                    stopped_for = "deadline"
                if stopped_for is not None:
                    log.info("job %s: stopping its ranks (%s)", job_id, stopped_for)
                    stop_group(proc, grace=settings.cancel_grace_seconds)
    finally:
        kill_group(proc)
        if left := sweep_ranks(job_id):
            log.warning("job %s: killed %d rank processes left behind by torchrun", job_id, left)
    reporter.collect(final=True)
    # The last reports matter (final metrics, the last checkpoint): ride out a database restart,
    # but not forever, so the end state still gets recorded.
    flush_deadline = time.monotonic() + FINAL_FLUSH_SECONDS
    while not reporter.flush():
        if time.monotonic() > flush_deadline:
            log.error("job %s: giving up on the last reports after %d s", job_id, FINAL_FLUSH_SECONDS)
            break
        time.sleep(min(5.0, settings.report_interval_seconds * 4))
    return _record_outcome(
        sessions,
        settings=settings,
        reporter=reporter,
        att=att,
        rc=proc.returncode,
        stopped_for=stopped_for,
        paths=paths,
        max_runtime=max_runtime,
        dispatcher=dispatcher,
    )


def _missing_checkpoints(sessions: sessionmaker[Session], *, job_id: str, directory: Path) -> str | None:
    """Why this attempt must not start: the job recorded checkpoints but none of their files is left."""
    with sessions() as session:
        rows = jobs_repository.checkpoints(session, job_id=job_id)
    if not rows or any(directory.glob("ckpt-*.pt")):
        return None
    return (
        f"the job recorded {len(rows)} checkpoints (last at step {rows[-1].step}) but {directory} holds none"
    )


def _sync_checkpoints(sessions: sessionmaker[Session], *, att: Attempt, directory: Path) -> None:
    """Make the job's checkpoint rows match its files before a restart.

    Ranks of a lost worker may have saved (and pruned, keep_last) checkpoints that nobody reported:
    list what is there, verified by its sidecar, and forget rows whose files are gone.
    """
    files: dict[int, Path] = {}
    for path in directory.glob("ckpt-*.pt"):
        if path.name[5:14].isdigit():
            files[int(path.name[5:14])] = path
    with sessions.begin() as session:
        rows = {c.step: c.path for c in jobs_repository.checkpoints(session, job_id=att.job_id)}
        gone = [path for step, path in rows.items() if step not in files]
        jobs_repository.delete_checkpoints(session, job_id=att.job_id, paths=gone)
        for step, path in sorted(files.items()):
            sidecar = path.with_name(path.name + ".sha256")
            if step in rows or not sidecar.exists():
                continue
            words = sidecar.read_text().split()
            row = {
                "job_id": att.job_id,
                "attempt": max(1, att.number - 1),
                "step": step,
                "path": str(path),
                "size_bytes": path.stat().st_size,
                "sha256": words[0] if words else "",
                "created_at": utcnow(),
            }
            jobs_repository.upsert_checkpoint(session, row=row)
        if not jobs_repository.fenced_update(session, job_id=att.job_id, claim_token=att.token, values={}):
            session.rollback()


def _record_outcome(
    sessions: sessionmaker[Session],
    *,
    settings: Settings,
    reporter: Reporter,
    att: Attempt,
    rc: int,
    stopped_for: str | None,
    paths: RunPaths,
    max_runtime: int | None,
    dispatcher: Dispatcher | None,
) -> JobStatus:
    job_id, token = att.job_id, att.token
    if stopped_for == "fenced":
        return JobStatus.RUNNING  # a newer attempt owns the job; record nothing
    if stopped_for == "cancel" or (reporter.state.cancel_requested and rc != 0):
        finish(sessions, job_id=job_id, token=token, dst=JobStatus.CANCELLED, reason="cancel requested")
        return JobStatus.CANCELLED
    if stopped_for == "deadline":
        error = {"type": "DeadlineExceeded", "message": f"deadline exceeded ({max_runtime} s)", "rank": None}
        finish(sessions, job_id=job_id, token=token, dst=JobStatus.FAILED, error=error)
        return JobStatus.FAILED
    if rc == 0 and reporter.state.finished:
        finish(sessions, job_id=job_id, token=token, dst=JobStatus.SUCCEEDED)
        return JobStatus.SUCCEEDED
    error = reporter.root_error() or {
        "type": "ProcessExited",
        "message": f"rank processes exited with code {rc}" if rc else "ranks exited without finishing",
        "rank": None,
        "traceback": _tail(paths.launcher_log),
    }
    return end_abnormally(sessions, settings=settings, att=att, error=error, dispatcher=dispatcher)


def _tail(path: Path, lines: int = TRACEBACK_TAIL_LINES) -> str | None:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return None
