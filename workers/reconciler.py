"""Republish queued jobs that nobody claimed: a submit whose publish failed is never lost.

The API commits the job row before publishing; if the broker was down, or the API died between
commit and publish, the row is there but no message is. Every worker runs this loop; duplicates
are harmless because a claim is a conditional UPDATE.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from service.config import get_settings
from service.dispatch import Dispatcher
from service.jobs import quota, repository
from service.models.base import utcnow

log = logging.getLogger(__name__)


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


class Reconciler(threading.Thread):
    """Runs republish_stale every `interval` seconds until stopped."""

    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        dispatcher: Dispatcher,
        after_seconds: float,
        interval: float,
        max_running_per_user: int | None = None,
    ) -> None:
        super().__init__(name="dptrain-reconciler", daemon=True)
        self.sessions, self.dispatcher = sessions, dispatcher
        self.after_seconds, self.interval = after_seconds, interval
        self.max_running = max_running_per_user or get_settings().max_running_jobs_per_user
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                republish_stale(
                    sessions=self.sessions, dispatcher=self.dispatcher, after_seconds=self.after_seconds
                )
                republish_deferred(
                    sessions=self.sessions, dispatcher=self.dispatcher, max_running=self.max_running
                )
            except Exception:  # noqa: BLE001 - e.g. the database restarting; try again next round
                log.warning("reconciler round failed", exc_info=True)
