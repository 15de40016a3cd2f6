"""Every worker's housekeeping loop: lost node starts, lost workers, expired history.

- Send again the start of a placed node that its worker never started: placement commits before it
  sends; if the sender died in between, or the broker lost the message, the row is there but no
  message is. (A publish the broker refused is tried again within seconds by the sender itself,
  service/dispatch.py.) Duplicates are harmless because a node starts only through a conditional
  UPDATE.
- Take running jobs away when any of their nodes' workers stopped beating (the attempt lease) and
  restart or fail them, fenced by the attempt's claim token.
- Delete the log lines and metric points of jobs finished longer ago than the retention, and the
  code archives no job refers to that nobody used for as long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from rank_contract.failures import Failure
from rank_contract.layout import code_archive
from service.code import repository as code_repository
from service.code.storage import sweep_partial_uploads
from service.config import Settings
from service.dispatch import Dispatcher
from service.jobs import repository
from service.models.base import utcnow
from service.scheduling import repository as scheduling
from service.scheduling.service import republish_unstarted
from workers.attempt.end import end_abnormally
from workers.attempt.node_run import Attempt
from workers.attempt.runner import active
from workers.sandbox.procs import sweep_ranks

log = logging.getLogger(__name__)

# History retention is measured in days: checking every 10 minutes is plenty.
PURGE_EVERY_SECONDS = 600.0
# A code upload still being received after this long was left by an API process that died.
PARTIAL_UPLOAD_SECONDS = 86_400.0


def recover_lost(
    *,
    sessions: sessionmaker[Session],
    lease_seconds: float,
    me: str | None = None,
    running_here: set[tuple[str, int]] | frozenset[tuple[str, int]] = frozenset(),
    others: bool = True,
) -> list[str]:
    """End every running attempt one of whose nodes' workers lost its lease; returns those jobs' ids.

    A worker holds its nodes' leases while its heartbeat is younger than `lease_seconds`. A lost
    attempt is ended with a conditional update on its claim token, so a worker that comes back
    finds itself fenced out (its reporter stops its ranks and writes nothing more), and so do the
    attempt's other nodes. A started node on this worker (`me`) whose (job, attempt) is not in `running_here`
    is lost too: its run ended without recording its end (the database was down for longer than
    the runner retries), or this worker process restarted: it runs nothing of an earlier process's.
    With `others` False, only those: what a worker ends at its start, without waiting for any lease.
    """
    now = utcnow()
    cutoff = now - timedelta(seconds=lease_seconds)
    with sessions() as session:
        leases = scheduling.leases(session)
    lost: dict[str, tuple[Attempt, str, str]] = {}
    for job_id, token, attempt, max_restarts, worker, placed, started, beat in leases:
        if job_id in lost:
            continue
        if me is not None and worker == me:
            if (job_id, attempt) in running_here or started is None:
                continue
            why = f"worker {worker} lost: its node of the attempt ended without recording an end state"
        elif not others:
            continue
        elif beat is not None:
            if beat >= cutoff:
                continue
            why = f"worker {worker} lost: no heartbeat for {(now - beat).total_seconds():.0f} s"
        elif placed < cutoff:
            why = f"worker {worker} lost: it is no longer registered"
        else:
            continue  # just placed on a worker whose first beat is not in yet
        att = Attempt(job_id=job_id, number=attempt, token=token, max_restarts=max_restarts)
        lost[job_id] = (att, worker, why)
    for job_id, (att, worker, why) in lost.items():
        # Ranks the dead worker left on this host must not keep writing checkpoints; on other hosts
        # the next attempt's runner sweeps them before it starts.
        sweep_ranks(job_id, node=worker)
        error = JobError(type=Failure.WORKER_LOST, message=why)
        status = end_abnormally(sessions, att=att, error=error)
        log.warning("job %s: %s; %s", job_id, why, "requeued" if status is JobStatus.QUEUED else "failed")
    return list(lost)


def purge_expired(
    *, sessions: sessionmaker[Session], retention_days: float, artifacts: Path | None = None
) -> int:
    """Delete the log lines and metrics of jobs finished over `retention_days` ago; returns how many jobs.

    With `artifacts`, also the code archives no job refers to and nobody used in that time, and
    (whatever the retention) uploads left half-received for a day.
    """
    # Not history but litter, whatever the retention: no upload takes a day.
    if artifacts is not None and (
        n := sweep_partial_uploads(artifacts, older_than_seconds=PARTIAL_UPLOAD_SECONDS)
    ):
        log.info("deleted %d half-received code uploads", n)
    if retention_days <= 0:
        return 0
    cutoff = utcnow() - timedelta(days=retention_days)
    if artifacts is not None:
        with sessions.begin() as session:
            unused = code_repository.delete_unused(session, used_before=cutoff)
        # Files after the commit: an archive whose row is gone is one the API no longer offers.
        for sha in unused:
            code_archive(artifacts, sha).unlink(missing_ok=True)
        if unused:
            log.info("deleted %d unused code archives past the %g-day retention", len(unused), retention_days)
    total = 0
    while True:
        with sessions.begin() as session:
            n = repository.purge_history(session, finished_before=cutoff)
        total += n
        if n == 0:
            break
    if total:
        log.info("deleted the logs and metrics of %d jobs past the %g-day retention", total, retention_days)
    return total


class Reconciler(threading.Thread):
    """Runs its parts every `interval` seconds until stopped; `on_freed` is called when it freed nodes."""

    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        dispatcher: Dispatcher,
        settings: Settings,
        me: str | None = None,
        on_freed: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="dptrain-reconciler", daemon=True)
        self.me = me  # this worker's node name, as placement records it
        self.sessions, self.dispatcher, self.settings = sessions, dispatcher, settings
        self.on_freed = on_freed
        self.interval = settings.reconcile_interval_seconds
        self.stopped = threading.Event()
        self._last_purge = -PURGE_EVERY_SECONDS
        # Since when every round reached the database (a fresh worker also waits a lease first).
        self._db_ok_since: float | None = time.monotonic()

    def run_once(self) -> None:
        """One round; each part on its own, so a failing one does not starve the others."""
        s = self.settings
        now = time.monotonic()
        parts: list[Callable[[], object]] = [
            lambda: republish_unstarted(
                sessions=self.sessions, dispatcher=self.dispatcher, after_seconds=s.republish_after_seconds
            ),
        ]
        # After a database outage every worker's heartbeat is stale at once, though they are alive:
        # take leases only once the database has answered us for a whole lease (by then every live
        # worker has beaten again).
        if self._db_ok_since is not None and now - self._db_ok_since >= s.worker_lease_seconds:
            parts.append(self._recover)
        if now - self._last_purge > PURGE_EVERY_SECONDS:
            self._last_purge = now
            parts.append(
                lambda: purge_expired(
                    sessions=self.sessions, retention_days=s.history_retention_days, artifacts=s.artifacts
                )
            )
        for part in parts:
            try:
                part()
            except Exception:  # noqa: BLE001 - e.g. the database restarting; try again next round
                log.warning("reconciler round failed", exc_info=True)
                self._db_ok_since = None
                return
        if self._db_ok_since is None:
            self._db_ok_since = now

    def _recover(self) -> None:
        lost = recover_lost(
            sessions=self.sessions,
            lease_seconds=self.settings.worker_lease_seconds,
            me=self.me,
            running_here=active(),
        )
        if lost and self.on_freed is not None:
            self.on_freed()  # their nodes are free and restarts are queued: place them now

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.run_once()
