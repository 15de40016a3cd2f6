"""The events a rank writes and the runner reads: one typed model per kind, one JSON line per event.

Both sides import these models: the ranks (`EventWriter`) to write them, the runner's reporter
(`workers/reporting/reporter.py`) to read them back with `parse_event`. This module stays torch-free: the
Celery worker process imports it and never loads torch.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal, TextIO

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

# How much of a failing rank's traceback goes into its error event (and of torchrun's log into the
# error of an attempt whose ranks reported none).
TRACEBACK_TAIL_LINES = 40


class _Event(BaseModel):
    # `type` is declared here so that it comes first in every line (the subclasses narrow it);
    # NaN and infinity are written as JSON's usual extensions, so a non-finite metric reaches the
    # runner, which reports it in the job's log instead of storing it.
    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")

    type: str
    time: float = Field(default_factory=time.time, description="Unix time the event happened.")


class StartedEvent(_Event):
    """Rank 0 resumed (or started fresh) and is about to train: the rendezvous completed."""

    type: Literal["started"] = "started"
    world_size: int
    start_iter: int = 0
    total_steps: int
    device: str
    backend: str


class MetricsEvent(_Event):
    """One logged step's values (loss, lr, samples_per_s, step_time_s, grad_norm), from rank 0."""

    type: Literal["metrics"] = "metrics"
    step: int
    values: dict[str, float]


class CheckpointEvent(_Event):
    """Rank 0 saved the checkpoint of `step` and is about to prune the older ones of the steps in `deleted`.

    No path: the worker derives the file from the job's checkpoint folder and the step
    (rank_contract.checkpoints) and lists it only if it is a regular file there, whatever a rank wrote.
    Written before the pruning, so a kill in between leaves files the event did not list yet
    (the attempt's end reconciles them), never listed steps whose files are gone.
    """

    type: Literal["checkpoint"] = "checkpoint"
    step: int
    size_bytes: int
    sha256: str
    deleted: list[int] = Field(default_factory=list)
    # checkpoint.keep_best: this save is the job's best so far (the previous best is no longer).
    best: bool = False


class FinishedEvent(_Event):
    """Every rank finished its last step; written by rank 0."""

    type: Literal["finished"] = "finished"
    step: int


class ErrorEvent(_Event):
    """A rank failed: what it raised, and the tail of its traceback."""

    type: Literal["error"] = "error"
    rank: int
    error_type: str
    message: str
    traceback: str | None = None


class WarningEvent(_Event):
    """What the job's timeline should say about a rank that did not fail (a crash after its clean end)."""

    type: Literal["warning"] = "warning"
    rank: int
    message: str


Event = Annotated[
    StartedEvent | MetricsEvent | CheckpointEvent | FinishedEvent | ErrorEvent | WarningEvent,
    Field(discriminator="type"),
]
_EVENT: TypeAdapter[Event] = TypeAdapter(Event)


def parse_event(line: str | bytes) -> Event:
    """The event on one line; raises pydantic's ValidationError for bad JSON or a bad or unknown event."""
    return _EVENT.validate_json(line)


def describe(exc: BaseException) -> tuple[str, str]:
    """(type, message) for a rank's error, naming what a user can act on where we can tell."""
    text = str(exc)
    # An error raised on behalf of another process (loader_faults.LoaderProcessError) reports that
    # process's exception type: what the user's code raised, and what NOT_RETRIED judges.
    reported = getattr(exc, "reported_type", None)
    if isinstance(reported, str) and reported:
        return reported, text
    # Gloo and NCCL report a peer that never joined a collective as a bare "Timed out ..." error.
    if isinstance(exc, RuntimeError) and ("Timed out" in text or "Watchdog caught collective" in text):
        return (
            "CollectiveTimeout",
            "a collective timed out after engine.collective_timeout_seconds: another rank is stuck or gone "
            f"({text.strip()[:300]})",
        )
    return type(exc).__name__, text


class EventWriter:
    """Appends one JSON object per line to RUN_DIR/events/rank{RANK}.jsonl, flushed after each emit."""

    def __init__(self, path: str | os.PathLike[str], rank: int) -> None:
        self.path = Path(path)
        self.rank = rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Append, so a restarted attempt adds to (never truncates) what the launcher has already read.
        self._f: TextIO | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, event: Event) -> None:
        """Write one event as a line."""
        if self._f is not None:
            # One write per line, then flush: a reader never sees half an event unless we die mid-write,
            # and no fsync because the launcher reads from the same host's page cache.
            self._f.write(event.model_dump_json() + "\n")
            self._f.flush()

    def emit_many(self, events: Sequence[Event]) -> None:
        """Write the events, one line each, in one write and one flush."""
        if self._f is not None and events:
            # Still one line per event, all in a single write: readers (workers/reporting/tail.py) take whole
            # lines only, so a batch is never seen cut except by a crash mid-write, as for one event.
            self._f.write("".join(e.model_dump_json() + "\n" for e in events))
            self._f.flush()

    def error(self, exc: BaseException) -> ErrorEvent:
        """Record `exc` (type, message, traceback tail) as this rank's error event."""
        lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
        error_type, message = describe(exc)
        event = ErrorEvent(
            rank=self.rank,
            error_type=error_type,
            message=message,
            traceback="\n".join(lines[-TRACEBACK_TAIL_LINES:]),
        )
        self.emit(event)
        return event

    def close(self) -> None:
        """Close the file; later emits are dropped."""
        if self._f is not None:
            self._f.close()
            self._f = None
