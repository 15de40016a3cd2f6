"""A lane per receiver in the webhook worker: a receiver that hangs holds its own sends, nobody else's.

Celery hands deliveries to the worker's threads in the order they were published; a receiver that
holds each answer until the timeout would take every thread with its backlog, and the deliveries
of every other receiver would wait behind it. So at most `DPTRAIN_WEBHOOK_SENDS_PER_RECEIVER` sends
to one receiver (scheme, host, port: its DNS lookup included) run at once in a worker process; a
delivery beyond that waits in its receiver's lane, in memory and not in a thread, and is published
again when one of that receiver's sends ends. Celery has no per-key concurrency (its `rate_limit`
is per task type), hence this.

Nothing is lost with the memory: a waiting delivery was not claimed, so its row stays pending and
due, and the webhook worker's sweep publishes it again after a crash or a failed publish.
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit


def receiver_of(url: str) -> str:
    """The lane key of a webhook URL: its scheme, host (lower case) and port."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port or ''}"


class Lanes:
    """Who may send now, receiver by receiver; the deliveries that wait, in arrival order."""

    def __init__(self, *, width: int) -> None:
        self.width = width
        self._lock = threading.Lock()
        self._sending: dict[str, int] = {}
        # Insertion-ordered sets: a delivery published twice (a retry, the sweep) waits once.
        self._waiting: dict[str, dict[str, None]] = {}

    def enter(self, receiver: str, delivery_id: str) -> bool:
        """True if the caller may send to `receiver` now (then `leave` after); else it waits here."""
        with self._lock:
            if self._sending.get(receiver, 0) < self.width:
                self._sending[receiver] = self._sending.get(receiver, 0) + 1
                return True
            self._waiting.setdefault(receiver, {})[delivery_id] = None
            return False

    def leave(self, receiver: str) -> str | None:
        """End a send to `receiver`: the delivery that waited longest for it (to publish again), if any."""
        with self._lock:
            left = self._sending.get(receiver, 0) - 1
            if left > 0:
                self._sending[receiver] = left
            else:
                self._sending.pop(receiver, None)
            waiting = self._waiting.get(receiver)
            if not waiting:
                return None
            following = next(iter(waiting))
            del waiting[following]
            if not waiting:
                del self._waiting[receiver]
            return following
