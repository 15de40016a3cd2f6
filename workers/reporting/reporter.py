"""Ship what the ranks report (events, logs) to SQL in batches, retrying through database outages.

What a rank writes is hostile input: its text is escaped (workers/reporting/rank_text.py) and its volume
budgeted (logs, metric points) before it reaches SQL, and a batch the database refuses for its data
is written in parts, the refused rows dropped and the refusal noted once on the job's timeline, so
that no row can wedge a job's reports; an outage keeps the batch until the database is back.
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import stat
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import psycopg
from pydantic import ValidationError
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError
from rank_contract.checkpoints import checkpoint_name
from rank_contract.layout import EVENTS_FOLDER, EVENTS_GLOB, LOGS_FOLDER, LOGS_GLOB, rank_of
from service.config import get_settings
from service.files import open_beneath
from service.jobs import lifecycle, repository, stacks_repository
from service.jobs.stored import describe
from service.models import Metric
from service.models.base import utcnow
from workers.attempt.checkpoint_rows import checkpoint_sizes
from workers.attempt.watch import SHUTDOWN_GRACE_SECONDS, stopping
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
from workers.reporting.log_budget import LogBudget
from workers.reporting.metric_budget import MetricBudget
from workers.reporting.rank_text import escape_strings, escape_text, is_clean
from workers.reporting.tail import TailSet

log = logging.getLogger(__name__)

# How long the last reports of an attempt are retried through a database outage.
FINAL_FLUSH_SECONDS = 300

# How many checkpoint events an attempt's timeline names when their files are not there to list.
NOTED_REFUSALS = 5
# The ranks' warnings noted on an attempt's timeline entry; later ones go to the worker's log only.
MAX_WARNING_NOTES = 20
# What the columns hold: a metric's name (cut to it), its step (BIGINT: a point outside is not
# stored) and the job's progress (`jobs.step`, an INTEGER: progress stops at its top).
METRIC_NAME_CHARS: int = Metric.__table__.c.name.type.length  # type: ignore[attr-defined]
_BIGINT = (-(2**63), 2**63 - 1)
_MAX_PROGRESS = 2**31 - 1
# The errors by which a database refuses a batch for what it holds (a value it cannot store, a
# constraint), as opposed to being out of reach: raised wrapped by SQLAlchemy, or bare by the
# driver (the metrics' COPY runs on psycopg's cursor); an encoder's refusal is the same kind.
_REFUSALS = (
    sa_exc.DataError,
    sa_exc.IntegrityError,
    psycopg.DataError,
    psycopg.IntegrityError,
    sqlite3.DataError,
    sqlite3.IntegrityError,
    UnicodeError,
)


def _first_line(exc: BaseException) -> str:
    # SQLAlchemy's message goes on with the statement and its parameters: the first line says why.
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def refused(exc: BaseException) -> bool:
    """Whether `exc` is the database refusing the data it was given (never an outage: retry those)."""
    orig = exc.orig if isinstance(exc, sa_exc.StatementError) else None
    return isinstance(exc, _REFUSALS) or isinstance(orig, _REFUSALS)


def escape_event(event: Event) -> Event:
    """`event` with every string it carries escaped (reporting/rank_text.py); a metric name cut to fit too."""
    if isinstance(event, MetricsEvent):
        # The hot path: one scan of all the names, and the same event back when they are clean.
        if is_clean("".join(event.values)) and all(len(k) <= METRIC_NAME_CHARS for k in event.values):
            return event
        names = {k: escape_text(k)[:METRIC_NAME_CHARS] for k in event.values}
        values: dict[str, float] = {}
        for k, v in event.values.items():
            values[names[k]] = v  # two names escaped or cut to one: the last value wins, as in a dict
        return event.model_copy(update={"values": values})
    return type(event).model_validate(escape_strings(event.model_dump()))


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
    # The latest request for the ranks' stacks (workers/reporting/stack_watch.py), and where the ranks were
    # when a stall or a collective timeout ended the attempt, for its error message.
    stacks_requested_at: datetime | None = None
    stacks_summary: str | None = None


class Reporter:
    """Collects new events and log lines each tick and writes them in one transaction.

    Nothing is dropped but log lines past DPTRAIN_MAX_LOG_BYTES_PER_JOB (`max_log_bytes`, by
    default the process's setting; workers/reporting/log_budget.py), metric points past
    DPTRAIN_MAX_METRIC_POINTS_PER_JOB (`max_metric_points`; workers/reporting/metric_budget.py), and rows the
    database refuses to store: a batch stays pending until its transaction commits, so a database
    restart only delays it.
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
        max_metric_points: int | None = None,
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
        # (workers/reporting/tail.py), and a log file past the job's whole budget is counted, not read,
        # and emptied.
        self.events = TailSet(run_dir, EVENTS_FOLDER, EVENTS_GLOB)
        self.logs = TailSet(run_dir, LOGS_FOLDER, LOGS_GLOB, truncate_past=cap)
        self.state = RunState()
        # Points wait in `_metrics_incoming` until the budget knows what the job stored before.
        self._metrics_incoming: list[dict[str, Any]] = []
        self._metrics: list[dict[str, Any]] = []
        # Lines wait in `_incoming` until the budget knows what the job stored before (the first
        # flush reads it), then move to `_logs` (to write) or are dropped past the cap.
        self._incoming: list[dict[str, Any]] = []
        self._logs: list[dict[str, Any]] = []
        self._final = False
        # (lines, bytes) cut from the log files unread, past the budget, not yet counted by it.
        self._unread = (0, 0)
        # Names in logs/ or events/ that were links or no regular file, said once each in the job's log.
        self._unreadable_names: set[str] = set()
        self.log_budget = LogBudget(cap=cap, job_id=job_id, attempt=attempt)
        points = (
            max_metric_points if max_metric_points is not None else get_settings().max_metric_points_per_job
        )
        self.metric_budget = MetricBudget(cap=points)
        self.nodes = nodes  # the attempt's nodes, which share what is left of the log cap
        # The job's checkpoint folder, where a checkpoint event's file must be (None on a node other
        # than rank 0's: its events list no checkpoint).
        self.checkpoint_dir = checkpoint_dir
        self._checkpoints: list[dict[str, Any]] = []
        self._unchecked: list[CheckpointEvent] = []
        self._checkpoints_refused = 0  # checkpoint events this attempt whose file was not there to list
        self._deleted: list[int] = []
        self._progress_dirty = False
        # Warnings for the timeline, noted on the entry that started this attempt.
        self._notes: list[str] = []
        # Rows the database refused to store (dropped), and whether the timeline says so yet.
        self.refused_rows = 0
        self._refusal_noted = False
        self._step_only = False  # a progress write leaves out the latest metrics (they were refused)
        self._warnings_cut = False  # MAX_WARNING_NOTES reached

    def collect(self, *, final: bool = False) -> int:
        """Read new lines from the ranks' files into the pending batch; returns how many there were."""
        seen = 0
        for path, line in self.logs.read(final=final):
            seen += 1
            line = escape_text(line)
            self._incoming.append(
                {"job_id": self.job_id, "attempt": self.attempt, "rank": rank_of(path.name), "line": line}
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
                event = escape_event(parse_event(line))
            except ValidationError as exc:
                # Skipped, never fatal: a line cut by a rank's crash, or one this runner cannot read.
                why = describe(exc, limit=1)
                log.warning(
                    "job %s: skipped an event in %s (%s): %r", self.job_id, path.name, why, line[:200]
                )
                continue
            self._apply(event)
        if self.metric_budget.known:
            self._admit_metrics()
        return seen

    def _apply(self, event: Event) -> None:
        if isinstance(event, MetricsEvent):
            step = event.step
            values = event.values
            if not _BIGINT[0] <= step <= _BIGINT[1]:
                log.warning(
                    "job %s: metrics at step %d (outside a 64-bit integer) not stored", self.job_id, step
                )
                return
            bad = [k for k, v in values.items() if not math.isfinite(v)]
            if bad:
                # JSON (the API, JSONB) has no NaN or infinity; a non-finite value is reported in the
                # job's log, not stored as a point.
                log.warning("job %s: non-finite %s at step %d not stored", self.job_id, bad, step)
                values = {k: v for k, v in values.items() if k not in bad}
            self._metrics_incoming.extend(
                {"job_id": self.job_id, "attempt": self.attempt, "name": k, "step": step, "value": v}
                for k, v in values.items()
            )
            latest = self.state.latest_metrics
            if self.metric_budget.full:
                # Nor does a new name join the latest metrics past the budget: the job's row stays bounded.
                values = {k: v for k, v in values.items() if k in latest}
            latest.update(values)
            self._progress(step)
        elif isinstance(event, StartedEvent):
            self.state.started = True
            self._progress(event.start_iter)
        elif isinstance(event, CheckpointEvent):
            # Checked against the folder when the batch is written (`_check_checkpoints`): by then a
            # later event of the batch may have pruned it, and a step pruned needs no look.
            self._unchecked.append(event)
            self._deleted.extend(event.deleted)
        elif isinstance(event, FinishedEvent):
            self.state.finished = True
            self._progress(event.step)
        elif isinstance(event, ErrorEvent):
            self.state.errors.append(event)
        elif isinstance(event, WarningEvent):
            log.warning("job %s: %s", self.job_id, event.message)
            # Each note lengthens one timeline row: a rank writing warnings without end must not.
            if len(self.state.warnings) < MAX_WARNING_NOTES:
                self.state.warnings.append(event)
                self._notes.append(event.message)
            elif not self._warnings_cut:
                self._warnings_cut = True
                self._notes.append(f"further warnings of attempt {self.attempt} are in the worker's log only")

    def _progress(self, step: int) -> None:
        self.state.step = max(self.state.step, min(step, _MAX_PROGRESS))
        self._progress_dirty = True

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
                self._checkpoints_refused += 1
                # A job that forges events by the million gets a few notes, not a million.
                if self._checkpoints_refused <= NOTED_REFUSALS:
                    self._notes.append(f"checkpoint of step {event.step} not listed: {size}")
                elif self._checkpoints_refused == NOTED_REFUSALS + 1:
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
        for tails in (self.logs, self.events):
            sub = tails.folder
            for name in tails.refused:
                if f"{sub}/{name}" in self._unreadable_names:
                    continue
                self._unreadable_names.add(f"{sub}/{name}")
                # A file's name is the rank's choice too: escaped like its lines.
                line = escape_text(
                    f"[dptrain] {sub + '/' + name!r} was not read: it is a link or not a regular file"
                )
                log.warning("job %s: %s", self.job_id, line)
                self._incoming.append(
                    {"job_id": self.job_id, "attempt": self.attempt, "rank": None, "line": line}
                )

    def _admit_metrics(self) -> None:
        self._metrics.extend(self.metric_budget.admit(self._metrics_incoming))
        self._metrics_incoming = []
        if (warning := self.metric_budget.warning()) is not None:
            log.warning("job %s: %s", self.job_id, warning)
            self._notes.append(warning)
            # The launcher's own line, outside the log budget: a job whose log is full learns it too.
            line = f"[dptrain] {warning}"
            self._logs.append({"job_id": self.job_id, "attempt": self.attempt, "rank": None, "line": line})

    @property
    def pending(self) -> bool:
        """Whether collected reports wait to be written."""
        logs = self._logs or self._incoming or self._unread != (0, 0)
        metrics = self._metrics or self._metrics_incoming
        dirty = self._progress_dirty or bool(self._notes)
        checkpoints = self._checkpoints or self._unchecked or self._deleted
        return bool(metrics or logs or checkpoints or dirty)

    def flush(self) -> bool:
        """Write the pending batch and read the cancel flag; False (batch kept) if the database failed.

        A batch the database refuses for its data is written in parts instead (`_flush_in_parts`);
        whatever failed, the cancel flag is still read, so a cancel never waits on the reports.
        """
        self._check_checkpoints()
        try:
            with self.sessions.begin() as session:
                self._write(session, self._pending(), progress=True)
        except Exception as exc:  # noqa: BLE001 - any database error: keep the batch and try again
            if not refused(exc):
                log.warning(
                    "job %s: reporting to the database failed; will retry", self.job_id, exc_info=True
                )
                self._read_flags()
                return False
            log.warning(
                "job %s: the database refused a report batch (%s); writing it in parts",
                self.job_id,
                _first_line(exc),
            )
            if not self._flush_in_parts():
                self._read_flags()
                return False
        self._keep({})
        self._progress_dirty = False
        self._notes = []
        return True

    def _pending(self) -> dict[str, list[Any]]:
        """The rows waiting to be written, by kind (the lists themselves: the budgets add to them)."""
        return {
            "metrics": self._metrics,
            "logs": self._logs,
            "checkpoints": self._checkpoints,
            "deleted": self._deleted,
        }

    def _keep(self, pending: dict[str, list[Any]]) -> None:
        """Set what stays pending of each kind of row (none of a kind not named)."""
        self._metrics = pending.get("metrics", [])
        self._logs = pending.get("logs", [])
        self._checkpoints = pending.get("checkpoints", [])
        self._deleted = pending.get("deleted", [])

    def _write(self, session: Session, rows: dict[str, list[Any]], *, progress: bool) -> None:
        """Write `rows` (by kind, as `_pending`); with `progress`, the progress and notes, and read the flags.

        Fenced: if another attempt owns the job now, nothing is written and the run learns it must stop.
        """
        if not self.log_budget.known or not self.metric_budget.known:
            # Admits what waited into the pending lists, which `rows` of a whole batch are.
            self._start_budgets(session)
        repository.add_metrics(session, rows=rows.get("metrics", []))
        repository.add_log_lines(session, rows=rows.get("logs", []))
        for row in rows.get("checkpoints", []):
            repository.upsert_checkpoint(session, row=row)
        repository.delete_checkpoints(session, job_id=self.job_id, steps=rows.get("deleted", []))
        # Only a change a client can see touches the job row (and so its updated_at, which
        # ETags and event streams follow); a quiet tick just checks the fence.
        values: dict[str, Any] = {}
        if progress and self._progress_dirty:
            values = {"step": self.state.step, "latest_metrics": dict(self.state.latest_metrics)}
            if self._step_only:
                del values["latest_metrics"]
        if not repository.fenced_update(
            session, job_id=self.job_id, claim_token=self.claim_token, values=values
        ):
            # Another attempt owns the job now: this one must stop, and writes nothing.
            self.state.fenced_out = True
            session.rollback()
            return
        if progress:
            for note in self._notes:
                lifecycle.note_running(session, job_id=self.job_id, attempt=self.attempt, note=note)
            self._read_flags_in(session)

    def _flush_in_parts(self) -> bool:
        """Write the pending batch a part at a time, halving a refused part down to the rows refused.

        The refused rows are dropped, and the job's timeline says so once. False if the database
        became unreachable meanwhile: what is not written yet stays pending.
        """
        kinds = list(self._pending().items())
        for i, (kind, rows) in enumerate(kinds):
            parts: deque[list[Any]] = deque([rows] if rows else [])
            while parts:
                part = parts.popleft()
                try:
                    with self.sessions.begin() as session:
                        self._write(session, {kind: part}, progress=False)
                except Exception as exc:  # noqa: BLE001 - sorted below: a refusal, or an outage
                    if not refused(exc):
                        # Unreachable: keep what was not written, in order, for the next flush.
                        left = [row for p in (part, *parts) for row in p]
                        self._keep({kind: left, **{k: r for k, r in kinds[i + 1 :]}})
                        log.warning("job %s: reporting to the database failed; will retry", self.job_id)
                        return False
                    if len(part) == 1:
                        self._drop_refused_row(kind, part[0], exc)
                        continue
                    half = len(part) // 2
                    parts.extendleft([part[half:], part[:half]])
                if self.state.fenced_out:
                    return True
        self._keep({})
        return self._flush_progress()

    def _drop_refused_row(self, kind: str, row: Any, exc: BaseException) -> None:
        """Drop a row the database refused; the job's timeline says so the first time."""
        self.refused_rows += 1
        if kind == "metrics":
            # Its name would be refused in the latest metrics too.
            self.state.latest_metrics.pop(row["name"], None)
        why = _first_line(exc)
        log.warning("job %s: the database refused a report, dropped (%s): %.300r", self.job_id, why, row)
        if not self._refusal_noted:
            self._refusal_noted = True
            self._notes.append(
                escape_text(
                    f"the database refused some of the reports of this attempt, which were dropped "
                    f"({why[:300]}); the worker's log names each"
                )
            )

    def _flush_progress(self) -> bool:
        """Write the progress and the notes, giving up on what is refused: latest metrics, step, notes."""
        try:
            for attempt in ("all", "step", "notes", "flags"):
                self._step_only = attempt == "step"
                try:
                    with self.sessions.begin() as session:
                        self._write(session, {}, progress=True)
                    return True
                except Exception as exc:  # noqa: BLE001 - sorted below: a refusal, or an outage
                    if not refused(exc):
                        return False
                    why = _first_line(exc)
                    log.warning(
                        "job %s: the database refused its progress (%s): %s", self.job_id, attempt, why
                    )
                    if attempt == "step":
                        self._progress_dirty = False
                    elif attempt == "notes":
                        self._notes = []
            return False
        finally:
            self._step_only = False

    def _read_flags(self) -> None:
        """Read the cancel flag and a stacks request in a transaction of their own (the batch failed)."""
        try:
            with self.sessions.begin() as session:
                if not repository.fenced_update(
                    session, job_id=self.job_id, claim_token=self.claim_token, values={}
                ):
                    self.state.fenced_out = True
                    return
                self._read_flags_in(session)
        except Exception:  # noqa: BLE001 - unreachable: the next tick tries again
            log.debug("job %s: reading its cancel flag failed", self.job_id, exc_info=True)

    def _read_flags_in(self, session: Session) -> None:
        self.state.cancel_requested = repository.cancel_requested(session, job_id=self.job_id)
        self.state.stacks_requested_at = stacks_repository.requested_at(session, job_id=self.job_id)

    def _start_budgets(self, session: Session) -> None:
        # Read once an attempt: what earlier attempts (and this attempt's other nodes) stored.
        if not self.log_budget.known:
            stored = repository.stored_log_bytes(session, job_id=self.job_id)
            self.log_budget.start(stored=stored, nodes=self.nodes)
            self._admit()
        if not self.metric_budget.known:
            points = repository.stored_metric_points(session, job_id=self.job_id)
            self.metric_budget.start(stored=points, nodes=self.nodes)
            self._admit_metrics()

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
    started = time.monotonic()
    while not reporter.flush():
        # A worker told to stop must be gone within seconds (`docker stop`, systemd): its attempt is
        # handed back, and the next one reads on from the last checkpoint.
        patience = SHUTDOWN_GRACE_SECONDS if stopping.is_set() else FINAL_FLUSH_SECONDS
        if time.monotonic() - started > patience:
            log.error("job %s: giving up on the last reports after %d s", job_id, patience)
            break
        time.sleep(min(5.0, interval * 4, patience))
