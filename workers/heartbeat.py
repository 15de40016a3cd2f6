"""Each worker process says every few seconds that it is alive, on what devices, with how many slots."""

from __future__ import annotations

import logging
import os
import socket
import threading

from sqlalchemy.orm import Session, sessionmaker

from service.models.base import utcnow
from service.workers import repository

log = logging.getLogger(__name__)


def device_count(device: str) -> int:
    """GPUs a cuda worker sees, logical cores for a cpu one."""
    if device == "cuda":
        import torch  # the worker has torch; only the API must not import it

        return int(torch.cuda.device_count())
    return os.cpu_count() or 1


class Heartbeat(threading.Thread):
    """Refreshes this worker's row every `interval` seconds until stopped, then removes it."""

    def __init__(
        self, *, sessions: sessionmaker[Session], name: str, device: str, slots: int, interval: float
    ) -> None:
        super().__init__(name="dptrain-heartbeat", daemon=True)
        self.sessions, self.worker, self.device = sessions, name, device
        self.slots, self.interval = slots, interval
        self.count = device_count(device)
        self.stopped = threading.Event()

    def beat(self) -> None:
        """Write one heartbeat."""
        with self.sessions.begin() as session:
            repository.heartbeat(
                session,
                name=self.worker,
                hostname=socket.gethostname(),
                device=self.device,
                device_count=self.count,
                slots=self.slots,
                now=utcnow(),
            )

    def run(self) -> None:
        while True:
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - e.g. the database restarting; the next beat tries again
                log.warning("heartbeat failed", exc_info=True)
            if self.stopped.wait(self.interval):
                break
        try:
            with self.sessions.begin() as session:
                repository.remove(session, name=self.worker)
        except Exception:  # noqa: BLE001 - left behind, it shows as lost
            log.warning("could not remove this worker's row", exc_info=True)
