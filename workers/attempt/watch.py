"""Why and when a node stops its ranks: cancel, deadline, fencing, a stall, outputs, checkpoints.

Outputs: the job's DPTRAIN_OUTPUT_DIR went over its limits (workers/attempt/outputs.py). Checkpoints: its
checkpoint folder went over DPTRAIN_MAX_CHECKPOINT_BYTES_PER_JOB (workers/attempt/checkpoint_cap.py).

A hung rank never fails on its own (a collective waiting on a dead peer, a script blocked on I/O),
so silence is a failure too: no step reported and no log line written for the job's
`stall_timeout_seconds` ends the attempt. A command job is asked first (the SDK's `should_stop()`
sees the stop file) and signalled only after the grace period, so it can checkpoint and exit.

A worker that is told to stop (SIGTERM, SIGINT: systemd, `docker stop`, Ctrl-C on `dptrain up`)
stops every run's ranks too: Celery's warm shutdown would wait for its running tasks, which
supervise runs of hours. Each run hands its attempt back instead (requeued, not counted against the
job's restarts: workers/attempt/end.py) and resumes from its last checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

from rank_contract.files import touch_beneath


class StopReason(StrEnum):
    """Why a node stops its ranks before they end by themselves (workers/attempt/end.py records it)."""

    # A user asked to cancel the job (or a sweep to prune it).
    CANCEL = "cancel"
    # Another attempt owns the job, or another node of this one ended it: nothing is recorded here.
    FENCED = "fenced"
    # This worker process is shutting down: the attempt is handed back, not charged to the job.
    SHUTDOWN = "shutdown"
    # The job ran past its max_runtime_seconds.
    DEADLINE = "deadline"
    # Nothing heard from the ranks for the job's stall_timeout_seconds.
    STALL = "stall"
    # DPTRAIN_OUTPUT_DIR, or the checkpoint folder, went over its limits.
    OUTPUTS = "outputs"
    CHECKPOINTS = "checkpoints"


# Reasons a script is asked to stop before it is signalled; the others (fenced: another attempt
# owns the job; stall: nobody is listening; outputs, checkpoints: every second writes more) signal
# at once.
ASKED_FIRST = frozenset({StopReason.CANCEL, StopReason.DEADLINE})
# Set when this worker process begins to shut down (workers/node/celery_app.py): every run stops.
stopping = threading.Event()
# A stop for shutdown signals the ranks at once and SIGKILLs them after at most this long (a
# command's SIGTERM handler may save a checkpoint meanwhile): `dptrain up` must be gone, ranks
# included, within the 10 s that `docker stop` waits before its SIGKILL.
SHUTDOWN_GRACE_SECONDS = 3.0

__all__ = ["ASKED_FIRST", "SHUTDOWN_GRACE_SECONDS", "StopReason", "Watch", "stopping"]


class Watch:
    """The stop decision of one node's run: its reason, and when to signal torchrun's group."""

    def __init__(
        self,
        *,
        stall_seconds: float,
        grace: float,
        stop_file: Path | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stall_seconds, self.grace, self.stop_file, self.clock = stall_seconds, grace, stop_file, clock
        self.stopped_for: StopReason | None = None
        self._last_activity = clock()
        self._signal_at: float | None = None

    def active(self) -> None:
        """A rank reported something or wrote a log line: not stalled."""
        self._last_activity = self.clock()

    def stalled(self) -> bool:
        """Whether nothing has been heard from the ranks for the stall timeout."""
        return self.clock() - self._last_activity > self.stall_seconds

    def stop(self, reason: StopReason) -> None:
        """Decide to stop the ranks for `reason`: ask a command job first, else signal at once."""
        self.stopped_for = reason
        delay = 0.0
        # The ranks own the folder: a link or a FIFO put there is never written through. Unable to
        # ask: the signal still comes.
        ask = self.stop_file if reason in ASKED_FIRST else None
        if ask is not None and touch_beneath(ask.parent, ask.name):
            delay = self.grace
        self._signal_at = self.clock() + delay

    def kill_after(self) -> float:
        """Seconds from the signal to SIGKILL: the grace, shorter when the worker shuts down."""
        return (
            min(self.grace, SHUTDOWN_GRACE_SECONDS) if self.stopped_for is StopReason.SHUTDOWN else self.grace
        )

    def signal_due(self) -> bool:
        """True once, when the ranks' grace to stop by themselves is over."""
        if self._signal_at is None or self.clock() < self._signal_at:
            return False
        self._signal_at = None
        return True
