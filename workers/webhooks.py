"""The webhook worker: a Celery app of its own on the webhook queue, so slow receivers hold no node's start.

`dptrain webhooks` runs it (threads; each delivery is one POST bounded by DPTRAIN_WEBHOOK_TIMEOUT_SECONDS)
with the sweep that publishes again what a lost message left pending.
"""

from __future__ import annotations

from celery import Celery, Task

from service.config import Settings
from service.db import session_factory
from service.dispatch import celery_config
from service.webhooks.delivery import deliver
from service.webhooks.publisher import DELIVER_TASK, publisher_for
from service.webhooks.sweep import Sweep


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

    # Not shared: the node worker's app must not consume deliveries (their own queue and worker).
    @app.task(name=DELIVER_TASK, bind=True, shared=False)
    def deliver_webhook(self: Task, delivery_id: str) -> None:  # type: ignore[type-arg]
        """One attempt at a delivery; a failed one is published again after its backoff."""
        delay = deliver(sessions=sessions, settings=settings, delivery_id=delivery_id)
        if delay is not None:
            # Should this message be lost, the sweep finds the row due all the same.
            publisher.send(delivery_id, countdown=delay)

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
