"""How many metric points a job keeps: DPTRAIN_MAX_METRIC_POINTS_PER_JOB, all attempts and nodes together.

A rank may report without end (every micro-step, a metric per parameter, a loop gone wrong: one
reported 500,000 points in a second), and every value is a row. Points are kept in order until the
cap, then dropped: the job runs on (its progress still moves), and its timeline and log say once
that the cap was reached. Counted like the log (workers/reporting/log_budget.py): each node of an attempt may
add an equal share of what the job had left when it began.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.reporting.log_budget import node_share

CAP_SETTING = "DPTRAIN_MAX_METRIC_POINTS_PER_JOB"


@dataclass
class MetricBudget:
    """The metric points of one attempt on one node, kept while the job's stored points stay under `cap`."""

    cap: int
    # Points this node may store in all: unknown until the database said what the job already holds.
    limit: int | None = None
    used: int = 0
    dropped: int = 0
    # Whether the job has been told (by this node, or by whoever filled the budget before it began).
    told: bool = False

    def start(self, *, stored: int, nodes: int) -> None:
        """Set the limit from the points the job has stored before (earlier attempts, other nodes)."""
        self.used = stored
        self.limit = node_share(cap=self.cap, stored=stored, nodes=nodes)
        # A job that reached the cap before this attempt has said so already: once is enough.
        self.told = stored >= self.cap

    @property
    def known(self) -> bool:
        """Whether `start` ran, so points can be admitted."""
        return self.limit is not None

    @property
    def full(self) -> bool:
        """Whether this node may store no more points."""
        return self.limit is not None and self.used >= self.limit

    def admit(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows to store of `rows`, in order: the first ones, while the limit allows."""
        assert self.limit is not None, "start() first"
        room = max(0, self.limit - self.used)
        kept = rows[:room]
        self.used += len(kept)
        self.dropped += len(rows) - len(kept)
        return kept

    def warning(self) -> str | None:
        """What to tell the job, once, after the first point was dropped; None otherwise."""
        if self.told or not self.dropped:
            return None
        self.told = True
        return (
            f"this job reached {CAP_SETTING} ({self.cap} points): further metric points are dropped "
            "(progress still moves; the job runs on)"
        )
