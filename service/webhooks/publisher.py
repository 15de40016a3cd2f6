"""Publishing delivery tasks to the webhook queue from a thread of its own: no commit waits for the broker."""

from __future__ import annotations

import logging
import queue
import threading

from celery import Celery

from service.config import Settings
from service.dispatch import celery_config

log = logging.getLogger(__name__)

DELIVER_TASK = "dptrain.deliver_webhook"


class Publisher:
    """Sends `dptrain.deliver_webhook(id)` for each id handed to it, in the background."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.todo: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._app: Celery | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __call__(self, ids: list[str]) -> None:
        """Queue `ids` for publishing; never blocks."""
        for delivery_id in ids:
            self.todo.put(delivery_id)
        with self._lock:
            if self._thread is None:
                name = "dptrain-webhook-publisher"
                self._thread = threading.Thread(target=self._run, name=name, daemon=True)
                self._thread.start()

    def send(self, delivery_id: str, *, countdown: float | None = None) -> None:
        """Publish one delivery task now (the sweep and the retries call this)."""
        if self._app is None:
            app = Celery("dptrain-webhooks-publisher")
            app.conf.update(celery_config(self.settings))
            self._app = app
        # No retry: an unreachable broker must not hold this thread; the sweep sends it later.
        self._app.send_task(
            DELIVER_TASK,
            args=[delivery_id],
            queue=self.settings.webhook_queue,
            countdown=countdown,
            retry=False,
        )

    def _run(self) -> None:
        while True:
            delivery_id = self.todo.get()
            try:
                self.send(delivery_id)
            except Exception:  # noqa: BLE001 - the row stays pending: the webhook worker's sweep sends it
                log.warning("publishing webhook delivery %s failed", delivery_id, exc_info=True)


_PUBLISHERS: dict[tuple[str, str], Publisher] = {}
_PUBLISHERS_LOCK = threading.Lock()


def publisher_for(settings: Settings) -> Publisher:
    """One publisher (one thread, one broker connection) per broker and queue in this process."""
    key = (settings.broker_url, settings.webhook_queue)
    with _PUBLISHERS_LOCK:
        if key not in _PUBLISHERS:
            _PUBLISHERS[key] = Publisher(settings)
        return _PUBLISHERS[key]
