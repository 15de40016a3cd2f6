"""Per-rank JSON-lines event log that the launcher tails to learn progress."""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

# How much of a failing rank's traceback goes into its error event.
TRACEBACK_TAIL_LINES = 40


def events_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank `rank` writes its events."""
    return Path(run_dir) / "events" / f"rank{rank}.jsonl"


def describe(exc: BaseException) -> tuple[str, str]:
    """(type, message) for a rank's error, naming what a user can act on where we can tell."""
    text = str(exc)
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

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        """Write one event `{"type": ..., "time": ..., **fields}` and return it."""
        event: dict[str, Any] = {"type": type_, "time": time.time(), **fields}
        if self._f is not None:
            # One write per line, then flush: a reader never sees half an event unless we die mid-write,
            # and no fsync because the launcher reads from the same host's page cache.
            self._f.write(json.dumps(event) + "\n")
            self._f.flush()
        return event

    def emit_many(self, type_: str, items: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Write one `type_` event per item (an item may set its own `time`), in one write and one flush."""
        now = time.time()
        events: list[dict[str, Any]] = [{"type": type_, "time": now, **fields} for fields in items]
        if self._f is not None and events:
            # Still one line per event, all in a single write: readers (workers/tail.py) take whole
            # lines only, so a batch is never seen cut except by a crash mid-write, as for one event.
            self._f.write("".join(json.dumps(e) + "\n" for e in events))
            self._f.flush()
        return events

    def error(self, exc: BaseException) -> dict[str, Any]:
        """Record `exc` (type, message, traceback tail) as this rank's error event."""
        lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
        error_type, message = describe(exc)
        return self.emit(
            "error",
            rank=self.rank,
            error_type=error_type,
            message=message,
            traceback="\n".join(lines[-TRACEBACK_TAIL_LINES:]),
        )

    def close(self) -> None:
        """Close the file; later emits are dropped."""
        if self._f is not None:
            self._f.close()
            self._f = None
