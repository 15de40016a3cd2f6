"""Each worker node says every few seconds that it is alive, where it is, what devices and slots it has."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.models.base import utcnow
from service.nodes import repository

log = logging.getLogger(__name__)


def device_count(device: str) -> int:
    """GPUs a cuda worker sees, logical cores for a cpu one."""
    if device == "cuda":
        import torch  # the worker has torch; only the API must not import it

        return int(torch.cuda.device_count())
    return os.cpu_count() or 1


def node_address(settings: Settings) -> str:
    """DPTRAIN_NODE_ADDRESS, else what this host's name resolves to (127.0.0.1 if it resolves to nothing)."""
    if settings.node_address:
        return settings.node_address
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def node_slots(settings: Settings, device: str) -> int:
    """DPTRAIN_NODE_SLOTS, else one rank per GPU (cuda) or per core (cpu)."""
    return settings.node_slots or max(1, device_count(device))


class Heartbeat(threading.Thread):
    """Refreshes this node's row every `interval` seconds until stopped, then removes it."""

    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        name: str,
        address: str,
        device: str,
        slots: int,
        interval: float,
        on_first_beat: Callable[[], None] | None = None,
        environments: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        super().__init__(name="dptrain-heartbeat", daemon=True)
        self.sessions, self.worker, self.address, self.device = sessions, name, address, device
        self.slots, self.interval = slots, interval
        self.count = device_count(device)
        self.on_first_beat = on_first_beat
        self.environments = environments
        self.stopped = threading.Event()

    def beat(self) -> None:
        """Write one heartbeat."""
        with self.sessions.begin() as session:
            repository.heartbeat(
                session,
                name=self.worker,
                hostname=socket.gethostname(),
                address=self.address,
                device=self.device,
                device_count=self.count,
                slots=self.slots,
                now=utcnow(),
                environments=self.environments() if self.environments is not None else None,
            )

    def run(self) -> None:
        first = True
        while True:
            try:
                self.beat()
                if first and self.on_first_beat is not None:
                    self.on_first_beat()  # new capacity: place what waits for it
                first = False
            except Exception:  # noqa: BLE001 - e.g. the database restarting; the next beat tries again
                log.warning("heartbeat failed", exc_info=True)
            if self.stopped.wait(self.interval):
                break
        try:
            with self.sessions.begin() as session:
                repository.remove(session, name=self.worker)
        except Exception:  # noqa: BLE001 - left behind, it shows as lost
            log.warning("could not remove this worker's row", exc_info=True)
