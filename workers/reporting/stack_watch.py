"""When a node reads its ranks' stacks (workers/reporting/stacks.py), and where the dump goes.

- On request (`GET /v1/jobs/{id}/stacks`): the report loop reads the job's latest request each
  flush (workers/reporting/reporter.py) and answers one it has not answered yet; the dump is stored
  (rank_stacks) for the API to answer with.
- When the stall watchdog ends the attempt, before its ranks are signalled; and as soon as a rank
  reports that a collective timed out (Gloo's "Timed out ...", NCCL's watchdog), while torchrun has
  not torn the other ranks down yet (best effort: a rank gone meanwhile is simply not in it). Such
  a dump is stored, written to the job's log under each rank, noted on the attempt's timeline
  entry, and its summary ("rank 1 in all_reduce (train.py:88); rank 0 in ...") ends the error
  message the attempt records (workers/attempt/end.record_outcome).

Each dump is best effort: nothing here may fail or stop a run.
"""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from api_schemas import StackDump, StackReason
from rank_contract.files import touch_beneath
from rank_contract.layout import RunFiles
from rank_contract.stacks import collective_timed_out
from service.jobs import lifecycle, repository, stacks_repository
from workers.attempt.watch import StopReason
from workers.reporting import stacks
from workers.reporting.rank_text import escape_strings, escape_text
from workers.reporting.reporter import Reporter, RunState

log = logging.getLogger(__name__)


class StackWatch:
    """One node's dumps of its ranks' stacks during an attempt."""

    def __init__(
        self, *, sessions: sessionmaker[Session], job_id: str, attempt: int, node: str, run_dir: Path
    ) -> None:
        self.sessions, self.job_id, self.attempt, self.node = sessions, job_id, attempt, node
        self.run_dir = run_dir
        self._answered: datetime | None = None
        self._at_end = False

    @classmethod
    def of(cls, reporter: Reporter, *, node: str) -> StackWatch:
        """The dumps of the attempt `reporter` reports for, on worker node `node`."""
        return cls(
            sessions=reporter.sessions,
            job_id=reporter.job_id,
            attempt=reporter.attempt,
            node=node,
            run_dir=reporter.run_dir,
        )

    def after_report(self, state: RunState) -> None:
        """After each flush: dump at a collective timeout a rank reported, or for a new request."""
        if not self._at_end and any(collective_timed_out(e.message) for e in state.errors):
            self.at_end(state, "collective timeout")
        requested = state.stacks_requested_at
        if requested is not None and requested != self._answered:
            self._answered = requested
            self._take("request", requested_at=requested)

    def before_stop(self, state: RunState, reason: StopReason) -> None:
        """The node is about to stop its ranks for `reason` (attempt/watch.py): dump them if they stalled."""
        if reason is StopReason.STALL:
            self.at_end(state, "stall")

    def at_end(self, state: RunState, reason: StackReason) -> None:
        """Dump before the attempt ends for `reason`; its summary goes to `state` for the error message."""
        if self._at_end:
            return
        self._at_end = True
        taken = self._take(reason, requested_at=None)
        # The rank whose collective timed out waits for this before it exits (rank_contract/stacks.py).
        # In the ranks' own folder: never through a link or a FIFO they put there (rank_contract.files).
        touch_beneath(self.run_dir, RunFiles(self.run_dir).stacks_taken.name)
        if taken is not None:
            state.stacks_summary = stacks.summary(taken)

    def _take(self, reason: StackReason, *, requested_at: datetime | None) -> StackDump | None:
        try:
            taken = stacks.dump(self.job_id, node=self.node, attempt=self.attempt, reason=reason)
        except Exception:  # noqa: BLE001 - a dump is a diagnosis, never a reason to fail the run
            log.warning("job %s: reading its ranks' stacks failed", self.job_id, exc_info=True)
            return None
        automatic = requested_at is None
        try:
            with self.sessions.begin() as session:
                row = stacks.row(taken, job_id=self.job_id, requested_at=requested_at)
                # Function and file names are the ranks' to choose: escaped (workers/reporting/rank_text.py).
                stacks_repository.add_dump(session, row={**row, "dump": escape_strings(row["dump"])})
                if automatic:
                    self._log(session, taken)
        except Exception:  # noqa: BLE001 - as above; the summary still reaches the error message
            log.warning("job %s: storing its ranks' stacks failed", self.job_id, exc_info=True)
        log.info("job %s: stacks (%s): %s", self.job_id, reason, stacks.summary(taken))
        return taken

    def _log(self, session: Session, taken: StackDump) -> None:
        rows = [
            {"job_id": self.job_id, "attempt": self.attempt, "rank": rank, "line": escape_text(line)}
            for rank, line in stacks.log_lines(taken)
        ]
        # The worker's own lines, bounded (workers/reporting/stacks.py), outside the job's log budget: the
        # evidence of a hang must not be lost to a chatty script.
        repository.add_log_lines(session, rows=rows)
        note = escape_text(f"stacks at the {taken.reason} ({self.node}): {stacks.summary(taken)}")
        lifecycle.note_running(session, job_id=self.job_id, attempt=self.attempt, note=note)
