"""The webhook worker: a Celery app of its own on the webhook queue, so slow receivers hold no node's start.

`dptrain webhook-worker` runs it (threads; each delivery is one POST bounded by
DPTRAIN_WEBHOOK_TIMEOUT_SECONDS, in its receiver's lane: `service.webhooks.lanes`) with the sweep that
publishes again what a lost message left pending.
"""

from __future__ import annotations

import logging

from celery import Celery, Task

from service.config import Settings
from service.db import session_factory
from service.dispatch import celery_config
from service.webhooks import repository
from service.webhooks.delivery import deliver
from service.webhooks.lanes import Lanes, receiver_of
from service.webhooks.publisher import DELIVER_TASK, publisher_for
from service.webhooks.sweep import Sweep

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> Celery:
    """The webhook worker's Celery app, its one task bound to `settings`."""
    app = Celery("dptrain-webhooks")
    app.conf.update(celery_config(settings))
    app.conf.update(
        worker_pool="threads",
        worker_hijack_root_logger=False,
        broker_connection_max_retries=None,
        task_default_queue=settings.webhook_queue,
    )
    sessions = session_factory(settings)
    publisher = publisher_for(settings)
    lanes = Lanes(width=settings.webhook_sends_per_receiver)

    # Not shared: the node worker's app must not consume deliveries (their own queue and worker).
    @app.task(name=DELIVER_TASK, bind=True, shared=False)
    def deliver_webhook(self: Task, delivery_id: str) -> None:  # type: ignore[type-arg]
        """One attempt at a delivery, in its receiver's lane; a failed one is sent again after backoff."""
        with sessions() as session:
            url = repository.pending_url(session, delivery_id=delivery_id)
        if url is None:
            return  # delivered, failed or deleted
        receiver = receiver_of(url)
        if not lanes.enter(receiver, delivery_id):
            return  # the receiver is busy: published again when one of its sends ends
        try:
            delay = deliver(sessions=sessions, settings=settings, delivery_id=delivery_id)
            if delay is not None:
                # Should this message be lost, the sweep finds the row due all the same.
                publisher.send(delivery_id, countdown=delay)
        finally:
            following = lanes.leave(receiver)
            if following is not None:
                try:
                    publisher.send(following)
                except Exception:  # noqa: BLE001 - its row stays pending and due: the sweep sends it
                    log.warning("publishing webhook delivery %s failed", following, exc_info=True)

    return app


def sweep_thread(settings: Settings) -> Sweep:
    """The periodic sweep of the webhook worker (not started)."""
    return Sweep(
        sessions=session_factory(settings),
        publish=publisher_for(settings).send,
        interval=settings.webhook_sweep_seconds,
    )


def worker_argv(settings: Settings, *, concurrency: int) -> list[str]:
    """`celery worker` arguments of the webhook worker."""
    return [
        "worker",
        "-Q",
        settings.webhook_queue,
        "-c",
        str(concurrency),
        "--loglevel",
        "INFO",
        "-n",
        f"dptrain-webhooks-{settings.node}@%h",
    ]
