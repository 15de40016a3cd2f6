"""How much of a job's output the database keeps: DPTRAIN_MAX_LOG_BYTES_PER_JOB, all attempts together.

A rank can print without end (a loop's debug line, a progress bar without newlines), and every line
would be a row: the cap keeps a job's log from filling the database. Lines are kept in order until
the cap, then dropped, with one marker line saying so when the first is dropped and one at the end
of the attempt counting what was dropped. Lines are never kept after a drop, so the log has no holes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CAP_SETTING = "DPTRAIN_MAX_LOG_BYTES_PER_JOB"


def node_share(*, cap: int, stored: int, nodes: int) -> int:
    """What one of an attempt's `nodes` may bring the job's total to, given what it has `stored`.

    Each node adds an equal share of what is left, so nodes that each read the total at their own
    start never add up to more than the cap between them.
    """
    return stored + max(0, cap - stored) // max(1, nodes)


def line_bytes(line: str) -> int:
    """The bytes a line takes in the database (UTF-8)."""
    return len(line.encode("utf-8", "replace"))


@dataclass
class LogBudget:
    """The log lines of one attempt on one node, kept while the job's stored bytes stay under `cap`."""

    cap: int
    job_id: str
    attempt: int
    # Bytes this node may store in all: unknown until the database said what the job already holds.
    limit: int | None = None
    used: int = 0
    dropped_lines: int = 0
    dropped_bytes: int = 0
    summarized: bool = False
    _full: bool = field(default=False, repr=False)

    def start(self, *, stored: int, nodes: int) -> None:
        """Set the limit from what the job has stored before (earlier attempts, nodes that began first)."""
        self.used = stored
        self.limit = node_share(cap=self.cap, stored=stored, nodes=nodes)

    @property
    def known(self) -> bool:
        """Whether `start` ran, so lines can be admitted."""
        return self.limit is not None

    def admit(
        self, rows: list[dict[str, Any]], *, final: bool = False, unread: tuple[int, int] = (0, 0)
    ) -> list[dict[str, Any]]:
        """The rows to store of `rows` (in order, markers included); with `final`, the count of the drops.

        `unread`: (lines, bytes) a log file held past the budget and was cut of unread
        (workers/reporting/tail.py), after `rows`: dropped, as any line past the cap.
        """
        assert self.limit is not None, "start() first"
        kept: list[dict[str, Any]] = []
        for row in rows:
            size = line_bytes(row["line"])
            if not self._full and self.used + size <= self.limit:
                kept.append(row)
                self.used += size
                continue
            self._drop(kept, lines=1, size=size)
        if unread != (0, 0):
            self._drop(kept, lines=unread[0], size=unread[1])
        if final and (self.dropped_lines or self.dropped_bytes) and not self.summarized:
            self.summarized = True
            kept.append(self._marker(self._summary()))
        return kept

    def _drop(self, kept: list[dict[str, Any]], *, lines: int, size: int) -> None:
        if not self._full:
            self._full = True
            kept.append(self._marker(self._reached()))
        self.dropped_lines += lines
        self.dropped_bytes += size

    def _reached(self) -> str:
        return (
            f"[dptrain] this job's log reached {CAP_SETTING} ({self.cap} bytes): further lines of "
            f"attempt {self.attempt} are dropped; their count follows when the attempt ends"
        )

    def _summary(self) -> str:
        return (
            f"[dptrain] attempt {self.attempt} dropped {self.dropped_lines} log lines "
            f"({self.dropped_bytes} bytes) past {CAP_SETTING} ({self.cap} bytes)"
        )

    def _marker(self, text: str) -> dict[str, Any]:
        # The launcher's own line (rank NULL); counted as stored, so the total stays known.
        self.used += line_bytes(text)
        return {"job_id": self.job_id, "attempt": self.attempt, "rank": None, "line": text}
