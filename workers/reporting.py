"""Ship what the ranks report (events, logs) to SQL in batches, retrying through database outages."""

from __future__ import annotations

import logging
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError
from rank_contract.checkpoints import checkpoint_name
from service.config import get_settings
from service.files import open_beneath
from service.jobs import lifecycle, repository, stacks_repository
from service.jobs.stored import describe
from service.models.base import utcnow
from workers.checkpoint_rows import checkpoint_sizes
from workers.engine.events import (
    CheckpointEvent,
    ErrorEvent,
    Event,
    FinishedEvent,
    MetricsEvent,
    StartedEvent,
    WarningEvent,
    parse_event,
)
from workers.log_budget import LogBudget
from workers.tail import TailSet

log = logging.getLogger(__name__)

# How long the last reports of an attempt are retried through a database outage.
FINAL_FLUSH_SECONDS = 300

_RANK_FILE = re.compile(r"rank(\d+)\.")
# How many checkpoint events an attempt's timeline names when their files are not there to list.
NOTED_REFUSALS = 5


def _rank_of(path: Path) -> int | None:
    m = _RANK_FILE.match(path.name)
    return int(m.group(1)) if m else None


@dataclass
class RunState:
    """What the launcher has learnt about the attempt so far."""

    step: int = 0
    latest_metrics: dict[str, float] = field(default_factory=dict)
    finished: bool = False
    # A rank started training (so the rendezvous, if any, completed).
    started: bool = False
    errors: list[ErrorEvent] = field(default_factory=list)
    warnings: list[WarningEvent] = field(default_factory=list)
    cancel_requested: bool = False
    fenced_out: bool = False
    # The latest request for the ranks' stacks (workers/stack_watch.py), and where the ranks were
    # when a stall or a collective timeout ended the attempt, for its error message.
    stacks_requested_at: datetime | None = None
    stacks_summary: str | None = None


class Reporter:
    """Collects new events and log lines each tick and writes them in one transaction.

    Nothing is dropped but log lines past DPTRAIN_MAX_LOG_BYTES_PER_JOB (`max_log_bytes`, by
    default the process's setting; workers/log_budget.py): a batch stays pending until its
    transaction commits, so a database restart only delays it.
    """

    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        job_id: str,
        attempt: int,
        claim_token: str,
        run_dir: Path,
        max_log_bytes: int | None = None,
        nodes: int = 1,
        checkpoint_dir: Path | None = None,
    ) -> None:
        self.sessions = sessions
        self.job_id = job_id
        self.attempt = attempt
        self.claim_token = claim_token
        self.run_dir = run_dir
        cap = max_log_bytes if max_log_bytes is not None else get_settings().max_log_bytes_per_job
        # The ranks write these folders: every file is opened beneath run_dir with no link followed
        # (workers/tail.py), and a log file past the job's whole budget is counted, not read, and emptied.
        self.events = TailSet(run_dir, "events", "rank*.jsonl")
        self.logs = TailSet(run_dir, "logs", "*.log", truncate_past=cap)
        self.state = RunState()
        self._metrics: list[dict[str, Any]] = []
        # Lines wait in `_incoming` until the budget knows what the job stored before (the first
        # flush reads it), then move to `_logs` (to write) or are dropped past the cap.
        self._incoming: list[dict[str, Any]] = []
        self._logs: list[dict[str, Any]] = []
        self._final = False
        # (lines, bytes) cut from the log files unread, past the budget, not yet counted by it.
        self._unread = (0, 0)
        # Names in logs/ or events/ that were links or no regular file, said once each in the job's log.
        self._refused: set[str] = set()
        self.log_budget = LogBudget(cap=cap, job_id=job_id, attempt=attempt)
        self.nodes = nodes  # the attempt's nodes, which share what is left of the log cap
        # The job's checkpoint folder, where a checkpoint event's file must be (None on a node other
        # than rank 0's: its events list no checkpoint).
        self.checkpoint_dir = checkpoint_dir
        self._checkpoints: list[dict[str, Any]] = []
        self._unchecked: list[CheckpointEvent] = []
        self._refused = 0  # checkpoint events this attempt whose file was not there to list
        self._deleted: list[int] = []
        self._progress_dirty = False
        # Warnings for the timeline, noted on the entry that started this attempt.
        self._notes: list[str] = []

    def collect(self, *, final: bool = False) -> int:
        """Read new lines from the ranks' files into the pending batch; returns how many there were."""
        seen = 0
        for path, line in self.logs.read(final=final):
            seen += 1
            self._incoming.append(
                {"job_id": self.job_id, "attempt": self.attempt, "rank": _rank_of(path), "line": line}
            )
        lines, size = self.logs.take_dropped()
        # Lines cut unread past the budget are still the ranks' activity (the stall watchdog's).
        seen += lines + (1 if size else 0)
        self._unread = (self._unread[0] + lines, self._unread[1] + size)
        self._final = self._final or final
        events = self.events.read(final=final)
        self._note_refused()
        if self.log_budget.known:
            self._admit()
        for path, line in events:
            seen += 1
            try:
                event = parse_event(line)
            except ValidationError as exc:
                # Skipped, never fatal: a line cut by a rank's crash, or one this runner cannot read.
                why = describe(exc, limit=1)
                log.warning(
                    "job %s: skipped an event in %s (%s): %r", self.job_id, path.name, why, line[:200]
                )
                continue
            self._apply(event)
        return seen

    def _apply(self, event: Event) -> None:
        if isinstance(event, MetricsEvent):
            step = event.step
            values = event.values
            bad = [k for k, v in values.items() if not math.isfinite(v)]
            if bad:
                # JSON (the API, JSONB) has no NaN or infinity; a non-finite value is reported in the
                # job's log, not stored as a point.
                log.warning("job %s: non-finite %s at step %d not stored", self.job_id, bad, step)
                values = {k: v for k, v in values.items() if k not in bad}
            self._metrics.extend(
                {"job_id": self.job_id, "attempt": self.attempt, "name": k, "step": step, "value": v}
                for k, v in values.items()
            )
            self.state.latest_metrics.update(values)
            self.state.step = max(self.state.step, step)
            self._progress_dirty = True
        elif isinstance(event, StartedEvent):
            self.state.started = True
            self.state.step = max(self.state.step, event.start_iter)
            self._progress_dirty = True
        elif isinstance(event, CheckpointEvent):
            # Checked against the folder when the batch is written (`_check_checkpoints`): by then a
            # later event of the batch may have pruned it, and a step pruned needs no look.
            self._unchecked.append(event)
            self._deleted.extend(event.deleted)
        elif isinstance(event, FinishedEvent):
            self.state.finished = True
            self.state.step = max(self.state.step, event.step)
            self._progress_dirty = True
        elif isinstance(event, ErrorEvent):
            self.state.errors.append(event)
        elif isinstance(event, WarningEvent):
            log.warning("job %s: %s", self.job_id, event.message)
            self.state.warnings.append(event)
            self._notes.append(event.message)

    def _check_checkpoints(self) -> None:
        """Turn the batch's checkpoint events into rows for the files that are really there.

        A rank writes the events, so nothing in one is trusted: the file is the job's own
        `<checkpoint folder>/<name of the step>`, never a path it names, and it must be a regular
        file there (opened beneath the folder, no link followed) or the step gets no row, with a
        warning in the job's timeline.
        """
        events, self._unchecked = self._unchecked, []
        pruned = set(self._deleted)
        for event in events:
            if event.step in pruned:
                continue  # pruned by a later save of the same batch (keep_last)
            size = self._checkpoint_file(event.step)
            if isinstance(size, str):
                log.warning("job %s: checkpoint of step %d not listed: %s", self.job_id, event.step, size)
                self._refused += 1
                # A job that forges events by the million gets a few notes, not a million.
                if self._refused <= NOTED_REFUSALS:
                    self._notes.append(f"checkpoint of step {event.step} not listed: {size}")
                elif self._refused == NOTED_REFUSALS + 1:
                    self._notes.append("more checkpoint events not listed (see the worker's log)")
                continue
            if size is None:
                continue
            self._checkpoints.append(
                {
                    "job_id": self.job_id,
                    "attempt": self.attempt,
                    "step": event.step,
                    # For operators: the API never opens it, it derives the file from job and step.
                    "path": str(cast(Path, self.checkpoint_dir) / checkpoint_name(event.step)),
                    "size_bytes": size,
                    "sha256": event.sha256,
                    "created_at": utcnow(),
                    # Written in the batch's transaction with the previous best's flag cleared, so
                    # the API never shows two best checkpoints, nor none while one exists.
                    "best": event.best,
                }
            )

    def _checkpoint_file(self, step: int) -> int | str | None:
        """The size of the checkpoint file of `step` in the job's folder; else why it is not listed.

        None: the file is gone but a newer checkpoint is there, as when keep_last pruned it since
        the save; the later save's event (or the attempt's end) says so, nothing to warn of.
        """
        if self.checkpoint_dir is None:
            return "reported by a node without the job's checkpoint folder"
        try:
            name = checkpoint_name(step)
        except ValueError as exc:
            return str(exc)
        f = open_beneath(self.checkpoint_dir, name)
        if f is not None:
            with f:
                return os.fstat(f.fileno()).st_size
        try:
            info = os.lstat(self.checkpoint_dir / name)
        except OSError:
            if any(s > step for s in checkpoint_sizes(self.checkpoint_dir)):
                return None
            return f"{name} is not in the job's checkpoint folder"
        return f"{name} is not a regular file ({stat.filemode(info.st_mode)})"

    def _admit(self) -> None:
        self._logs.extend(self.log_budget.admit(self._incoming, final=self._final, unread=self._unread))
        self._incoming, self._unread = [], (0, 0)

    def _note_refused(self) -> None:
        # The file is never read; the job's owner learns why its lines are missing (the launcher's
        # line, rank NULL, within the budget like any other).
        for sub, tails in (("logs", self.logs), ("events", self.events)):
            for name in tails.refused:
                if f"{sub}/{name}" in self._refused:
                    continue
                self._refused.add(f"{sub}/{name}")
                line = f"[dptrain] {sub + '/' + name!r} was not read: it is a link or not a regular file"
                log.warning("job %s: %s", self.job_id, line)
                self._incoming.append(
                    {"job_id": self.job_id, "attempt": self.attempt, "rank": None, "line": line}
                )

    @property
    def pending(self) -> bool:
        """Whether collected reports wait to be written."""
        logs = self._logs or self._incoming or self._unread != (0, 0)
        dirty = self._progress_dirty or bool(self._notes)
        checkpoints = self._checkpoints or self._unchecked or self._deleted
        return bool(self._metrics or logs or checkpoints or dirty)

    def flush(self) -> bool:
        """Write the pending batch and read the cancel flag; False (batch kept) if the database failed."""
        self._check_checkpoints()
        try:
            with self.sessions.begin() as session:
                if not self.log_budget.known:
                    self._start_log_budget(session)
                repository.add_metrics(session, rows=self._metrics)
                repository.add_log_lines(session, rows=self._logs)
                for row in self._checkpoints:
                    repository.upsert_checkpoint(session, row=row)
                repository.delete_checkpoints(session, job_id=self.job_id, steps=self._deleted)
                # Only a change a client can see touches the job row (and so its updated_at, which
                # ETags and event streams follow); a quiet tick just checks the fence.
                values: dict[str, Any] = {}
                if self._progress_dirty:
                    values = {"step": self.state.step, "latest_metrics": dict(self.state.latest_metrics)}
                if not repository.fenced_update(
                    session, job_id=self.job_id, claim_token=self.claim_token, values=values
                ):
                    # Another attempt owns the job now: this one must stop, and writes nothing.
                    self.state.fenced_out = True
                    session.rollback()
                    return True
                for note in self._notes:
                    lifecycle.note_running(session, job_id=self.job_id, attempt=self.attempt, note=note)
                self.state.cancel_requested = repository.cancel_requested(session, job_id=self.job_id)
                self.state.stacks_requested_at = stacks_repository.requested_at(session, job_id=self.job_id)
        except Exception:  # noqa: BLE001 - any database error: keep the batch and try again
            log.warning("job %s: reporting to the database failed; will retry", self.job_id, exc_info=True)
            return False
        self._metrics, self._logs, self._checkpoints, self._deleted = [], [], [], []
        self._progress_dirty = False
        self._notes = []
        return True

    def _start_log_budget(self, session: Session) -> None:
        # Read once an attempt: what earlier attempts (and this attempt's other nodes) stored.
        stored = repository.stored_log_bytes(session, job_id=self.job_id)
        self.log_budget.start(stored=stored, nodes=self.nodes)
        self._admit()

    def root_error(self) -> JobError | None:
        """The first error any rank reported (later ones are usually peers losing their connection)."""
        if not self.state.errors:
            return None
        return job_error(min(self.state.errors, key=lambda e: e.time))


def job_error(event: ErrorEvent) -> JobError:
    """The job's error body for a rank's error event: the one place the two shapes meet."""
    return JobError(type=event.error_type, message=event.message, rank=event.rank, traceback=event.traceback)


def final_flush(reporter: Reporter, *, interval: float, job_id: str) -> None:
    """Collect and report what the ranks wrote last, retrying through an outage until a deadline."""
    reporter.collect(final=True)
    # The last reports matter (final metrics, the last checkpoint): ride out a database restart,
    # but not forever, so the end state still gets recorded.
    flush_deadline = time.monotonic() + FINAL_FLUSH_SECONDS
    while not reporter.flush():
        if time.monotonic() > flush_deadline:
            log.error("job %s: giving up on the last reports after %d s", job_id, FINAL_FLUSH_SECONDS)
            break
        time.sleep(min(5.0, interval * 4))
