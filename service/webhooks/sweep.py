"""The webhook worker's periodic sweep: publish again the pending deliveries that are due.

Each change's deliveries are published after its commit; a publish lost with a crashed process or an
unreachable broker, and a retry whose delayed message died with a worker, leave a row pending. The
sweep finds them; a delivery published twice is sent once (the claim in `repository.claim`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from service.models.base import utcnow
from service.webhooks import repository

log = logging.getLogger(__name__)
# Deliveries published per round at most; the next round takes the rest.
SWEEP_BATCH = 1000


def sweep_once(*, sessions: sessionmaker[Session], publish: Callable[[str], None]) -> int:
    """Publish every due pending delivery (up to a batch); how many were published."""
    with sessions() as session:
        ids = repository.due(session, now=utcnow(), limit=SWEEP_BATCH)
    for delivery_id in ids:
        publish(delivery_id)
    return len(ids)


class Sweep(threading.Thread):
    """`sweep_once` every `interval` seconds until stopped."""

    def __init__(
        self, *, sessions: sessionmaker[Session], publish: Callable[[str], None], interval: float
    ) -> None:
        super().__init__(name="dptrain-webhook-sweep", daemon=True)
        self.sessions, self.publish, self.interval = sessions, publish, interval
        self.stopped = threading.Event()

    def stop(self) -> None:
        """End the thread after the current round."""
        self.stopped.set()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                sweep_once(sessions=self.sessions, publish=self.publish)
            except Exception:  # noqa: BLE001 - e.g. the database restarting: the next round tries again
                log.warning("webhook sweep failed", exc_info=True)
