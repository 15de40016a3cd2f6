"""Every worker's housekeeping loop: lost publishes, lost workers, expired history.

- Republish queued jobs that nobody claimed: the API commits the job row before publishing; if the
  broker was down, or the API died between commit and publish, the row is there but no message is.
  Duplicates are harmless because a claim is a conditional UPDATE.
- Take running jobs away from workers that stopped beating (the attempt lease) and restart or fail
  them, fenced by the attempt's claim token.
- Delete the log lines and metric points of jobs finished longer ago than the retention.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.config import Settings
from service.dispatch import Dispatcher
from service.jobs import quota, repository
from service.models.base import utcnow
from service.workers import repository as workers_repository
from workers.attempts import Attempt, end_abnormally
from workers.procs import sweep_ranks
from workers.runner import ACTIVE

log = logging.getLogger(__name__)

# History retention is measured in days: checking every 10 minutes is plenty.
PURGE_EVERY_SECONDS = 600.0


def republish_stale(
    *, sessions: sessionmaker[Session], dispatcher: Dispatcher, after_seconds: float, limit: int = 100
) -> list[str]:
    """Publish again every job queued and untouched for `after_seconds`; returns their ids."""
    with sessions.begin() as session:
        stale = repository.stale_queued(
            session, older_than=utcnow() - timedelta(seconds=after_seconds), limit=limit
        )
    sent = []
    for job_id, device in stale:
        try:
            dispatcher.send(job_id, device=device)
            sent.append(job_id)
        except Exception:  # noqa: BLE001 - the broker is still down: the next round tries again
            log.warning("republishing job %s failed", job_id, exc_info=True)
    if sent:
        log.info("republished %d queued jobs nobody had claimed: %s", len(sent), sent)
    return sent


def republish_deferred(
    *, sessions: sessionmaker[Session], dispatcher: Dispatcher, max_running: int, owner_id: int | None = None
) -> list[str]:
    """Publish the oldest jobs that the running-jobs limit deferred, as far as their owners have room.

    The runner calls this for the owner of a job that just ended; every reconciler round calls it
    for all owners, in case a worker died before it could.
    """
    with sessions.begin() as session:
        due = quota.take_deferred(session, max_running=max_running, owner_id=owner_id)
    sent = []
    for job_id, device in due:
        try:
            dispatcher.send(job_id, device=device)
            sent.append(job_id)
        except Exception:  # noqa: BLE001 - mark it again so the next round retries
            log.warning("republishing deferred job %s failed", job_id, exc_info=True)
            with sessions.begin() as session:
                quota.defer(session, job_id=job_id)
    if sent:
        log.info("published %d jobs deferred by the running-jobs limit: %s", len(sent), sent)
    return sent


def recover_lost(
    *,
    sessions: sessionmaker[Session],
    settings: Settings,
    dispatcher: Dispatcher,
    lease_seconds: float,
    me: str | None = None,
    running_here: set[str] | frozenset[str] = frozenset(),
) -> list[str]:
    """End every running attempt whose worker lost its lease; returns the ids of those jobs.

    A worker holds a job's lease while its heartbeat is younger than `lease_seconds`. A lost
    attempt is ended with a conditional update on its claim token, so a worker that comes back
    finds itself fenced out (its reporter stops its ranks and writes nothing more). A job held by
    this worker (`me`) but not in `running_here` is lost too: its attempt ended without recording
    its end state (the database was down for longer than the runner retries).
    """
    now = utcnow()
    cutoff = now - timedelta(seconds=lease_seconds)
    with sessions() as session:
        leases = workers_repository.leased_jobs(session)
    lost = []
    for job_id, worker, token, attempt, max_restarts, spec, started, beat in leases:
        if me is not None and worker == me:
            if job_id in running_here:
                continue
            why = f"worker {worker} lost: its attempt ended without recording an end state"
        elif beat is not None:
            if beat >= cutoff:
                continue
            why = f"worker {worker} lost: no heartbeat for {(now - beat).total_seconds():.0f} s"
        elif started is not None and started < cutoff:
            why = f"worker {worker} lost: it is no longer registered"
        else:
            continue  # just claimed by a worker whose first beat is not in yet
        # Ranks the dead worker left on this host must not keep writing checkpoints; on other hosts
        # the next attempt's runner sweeps them before it starts.
        sweep_ranks(job_id)
        att = Attempt(
            job_id=job_id,
            number=attempt,
            token=token,
            max_restarts=max_restarts,
            device=str(spec.get("resources", {}).get("device", "cpu")),
        )
        error = {"type": "WorkerLost", "message": why, "rank": None}
        status = end_abnormally(sessions, settings=settings, att=att, error=error, dispatcher=dispatcher)
        log.warning("job %s: %s; %s", job_id, why, "requeued" if status is JobStatus.QUEUED else "failed")
        lost.append(job_id)
    return lost


def purge_expired(*, sessions: sessionmaker[Session], retention_days: float) -> int:
    """Delete the log lines and metrics of jobs finished over `retention_days` ago; returns how many jobs."""
    if retention_days <= 0:
        return 0
    total = 0
    while True:
        with sessions.begin() as session:
            n = repository.purge_history(session, finished_before=utcnow() - timedelta(days=retention_days))
        total += n
        if n == 0:
            break
    if total:
        log.info("deleted the logs and metrics of %d jobs past the %g-day retention", total, retention_days)
    return total


class Reconciler(threading.Thread):
    """Runs republish_stale every `interval` seconds until stopped."""

    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        dispatcher: Dispatcher,
        settings: Settings,
        me: str | None = None,
    ) -> None:
        super().__init__(name="dptrain-reconciler", daemon=True)
        self.me = me  # this worker's name, as claims record it
        self.sessions, self.dispatcher, self.settings = sessions, dispatcher, settings
        self.interval = settings.reconcile_interval_seconds
        self.max_running = settings.max_running_jobs_per_user
        self.stopped = threading.Event()
        self._last_purge = -PURGE_EVERY_SECONDS
        # Since when every round reached the database (a fresh worker also waits a lease first).
        self._db_ok_since: float | None = time.monotonic()

    def run_once(self) -> None:
        """One round; each part on its own, so a failing one does not starve the others."""
        s = self.settings
        now = time.monotonic()
        parts: list[Callable[[], object]] = [
            lambda: republish_stale(
                sessions=self.sessions, dispatcher=self.dispatcher, after_seconds=s.republish_after_seconds
            ),
            # For every owner, in case a worker died before releasing what the running-jobs limit deferred.
            lambda: republish_deferred(
                sessions=self.sessions, dispatcher=self.dispatcher, max_running=self.max_running
            ),
        ]
        # After a database outage every worker's heartbeat is stale at once, though they are alive:
        # take leases only once the database has answered us for a whole lease (by then every live
        # worker has beaten again).
        if self._db_ok_since is not None and now - self._db_ok_since >= s.worker_lease_seconds:
            parts.append(
                lambda: recover_lost(
                    sessions=self.sessions,
                    settings=s,
                    dispatcher=self.dispatcher,
                    lease_seconds=s.worker_lease_seconds,
                    me=self.me,
                    running_here=frozenset(ACTIVE),
                )
            )
        if now - self._last_purge > PURGE_EVERY_SECONDS:
            self._last_purge = now
            parts.append(
                lambda: purge_expired(sessions=self.sessions, retention_days=s.history_retention_days)
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

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.run_once()
