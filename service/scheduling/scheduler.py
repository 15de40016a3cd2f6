"""A thread that runs placement when kicked (a submit, an attempt's end) and every few seconds anyway."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.dispatch import Dispatcher
from service.scheduling.service import schedule_once
from service.sweeps import driver as sweeps

log = logging.getLogger(__name__)

# A kick after a quiet spell starts a round at once (a job submitted to an idle cluster starts
# without delay). Under a stream of submits, rounds would otherwise run back to back, each reading
# reading the heads of every owner's queue, and placement would take a large share of the API
# process's CPU. This spaces them out: at most 2 rounds a second.
MIN_GAP_SECONDS = 0.5


class Kicker(Protocol):
    def kick(self) -> None: ...


class Scheduler(threading.Thread):
    """Placement rounds in the background: kicks that arrive during a round coalesce into one more."""

    def __init__(
        self, *, sessions: sessionmaker[Session], dispatcher: Dispatcher, settings: Settings
    ) -> None:
        super().__init__(name="dptrain-scheduler", daemon=True)
        self.sessions, self.dispatcher, self.settings = sessions, dispatcher, settings
        self.kicked = threading.Event()
        self.stopped = threading.Event()

    def kick(self) -> None:
        """Ask for a round as soon as possible; never blocks (a request thread calls it)."""
        self.kicked.set()

    def stop(self) -> None:
        """End the thread after the current round."""
        self.stopped.set()
        self.kicked.set()

    def run(self) -> None:
        last = -math.inf
        while not self.stopped.is_set():
            self.kicked.wait(self.settings.schedule_interval_seconds)
            if self.stopped.is_set():
                break
            # Kicks within MIN_GAP_SECONDS of the last round's start wait for the rest of the gap,
            # and the kicks that come meanwhile join them (cleared only now).
            gap = last + MIN_GAP_SECONDS - time.monotonic()
            if gap > 0 and self.stopped.wait(gap):
                break
            self.kicked.clear()
            last = time.monotonic()
            try:
                schedule_once(sessions=self.sessions, dispatcher=self.dispatcher, settings=self.settings)
                # Sweeps start their next trials (and prune, and end) on the same beat; the trials
                # they submitted are placed at once, in this round (at most max_concurrent_trials
                # each, not the stream of submits the gap is for).
                if sweeps.run_once(sessions=self.sessions, settings=self.settings):
                    schedule_once(sessions=self.sessions, dispatcher=self.dispatcher, settings=self.settings)
            except Exception:  # noqa: BLE001 - e.g. the database restarting: the next round tries again
                log.warning("placement round failed", exc_info=True)
