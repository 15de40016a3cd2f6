"""Ship what the ranks report (events, logs) to SQL in batches, retrying through database outages."""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError
from service.jobs import repository
from service.models.base import utcnow
from workers.tail import TailSet

log = logging.getLogger(__name__)

_RANK_FILE = re.compile(r"rank(\d+)\.")


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
    errors: list[dict[str, Any]] = field(default_factory=list)
    cancel_requested: bool = False
    fenced_out: bool = False


class Reporter:
    """Collects new events and log lines each tick and writes them in one transaction.

    Nothing is dropped: a batch stays pending until its transaction commits, so a database
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
    ) -> None:
        self.sessions = sessions
        self.job_id = job_id
        self.attempt = attempt
        self.claim_token = claim_token
        self.events = TailSet(run_dir / "events", "rank*.jsonl")
        self.logs = TailSet(run_dir / "logs", "*.log")
        self.state = RunState()
        self._metrics: list[dict[str, Any]] = []
        self._logs: list[dict[str, Any]] = []
        self._checkpoints: list[dict[str, Any]] = []
        self._deleted: list[str] = []
        self._progress_dirty = False

    def collect(self, *, final: bool = False) -> None:
        """Read new lines from the ranks' files into the pending batch."""
        for path, line in self.logs.read(final=final):
            self._logs.append(
                {"job_id": self.job_id, "attempt": self.attempt, "rank": _rank_of(path), "line": line}
            )
        for _path, line in self.events.read(final=final):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                log.warning("job %s: unreadable event line %r", self.job_id, line[:200])
                continue
            self._apply(event)

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "metrics":
            step = int(event["step"])
            values = {k: float(v) for k, v in event.get("values", {}).items()}
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
        elif kind == "started":
            self.state.started = True
            self.state.step = max(self.state.step, int(event.get("start_iter", 0)))
            self._progress_dirty = True
        elif kind == "checkpoint":
            self._checkpoints.append(
                {
                    "job_id": self.job_id,
                    "attempt": self.attempt,
                    "step": int(event["step"]),
                    "path": str(event["path"]),
                    "size_bytes": int(event["size_bytes"]),
                    "sha256": str(event["sha256"]),
                    "created_at": utcnow(),
                }
            )
            self._deleted.extend(str(p) for p in event.get("deleted", []))
        elif kind == "finished":
            self.state.finished = True
            self.state.step = max(self.state.step, int(event.get("step", 0)))
            self._progress_dirty = True
        elif kind == "error":
            self.state.errors.append(event)

    @property
    def pending(self) -> bool:
        """Whether collected reports wait to be written."""
        return bool(self._metrics or self._logs or self._checkpoints or self._deleted or self._progress_dirty)

    def flush(self) -> bool:
        """Write the pending batch and read the cancel flag; False (batch kept) if the database failed."""
        try:
            with self.sessions.begin() as session:
                repository.add_metrics(session, rows=self._metrics)
                repository.add_log_lines(session, rows=self._logs)
                for row in self._checkpoints:
                    repository.upsert_checkpoint(session, row=row)
                repository.delete_checkpoints(session, job_id=self.job_id, paths=self._deleted)
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
                self.state.cancel_requested = repository.cancel_requested(session, job_id=self.job_id)
        except Exception:  # noqa: BLE001 - any database error: keep the batch and try again
            log.warning("job %s: reporting to the database failed; will retry", self.job_id, exc_info=True)
            return False
        self._metrics, self._logs, self._checkpoints, self._deleted = [], [], [], []
        self._progress_dirty = False
        return True

    def root_error(self) -> JobError | None:
        """The first error any rank reported (later ones are usually peers losing their connection)."""
        if not self.state.errors:
            return None
        first = min(self.state.errors, key=lambda e: float(e.get("time", 0.0)))
        return JobError(
            type=str(first.get("error_type", "Error")),
            message=str(first.get("message", "")),
            rank=first.get("rank"),
            traceback=first.get("traceback"),
        )
