"""The worker's Celery app: same broker settings as the API's publisher, plus worker knobs."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import worker_ready, worker_shutdown

from service.config import get_settings
from service.dispatch import celery_config

settings = get_settings()
app = Celery("dptrain", include=["workers.tasks"])
app.conf.update(celery_config(settings))
app.conf.update(
    worker_concurrency=settings.worker_concurrency,
    # The task only supervises torchrun subprocesses, so threads are enough and avoid forking a
    # process that holds SQLAlchemy connections.
    worker_pool="threads",
    worker_hijack_root_logger=False,
    # A broker restart must not end a job that is running fine: keep the task running through a lost
    # connection (its unacked message may be delivered again, and the claim refuses that delivery),
    # and reconnect for as long as it takes. See docs/reliability.md.
    worker_cancel_long_running_tasks_on_connection_loss=False,
    broker_connection_max_retries=None,
)


_reconciler: Any = None
_heartbeat: Any = None


@worker_ready.connect
def _start_reconciler(sender: Any = None, **_: Any) -> None:
    global _reconciler, _heartbeat
    from service.db import session_factory
    from service.dispatch import CeleryDispatcher, queue_for
    from workers.heartbeat import Heartbeat
    from workers.reconciler import Reconciler
    from workers.runner import worker_name

    _reconciler = Reconciler(
        sessions=session_factory(settings),
        dispatcher=CeleryDispatcher(settings),
        settings=settings,
        me=worker_name(),
    )
    _reconciler.start()
    # `sender` is the worker's consumer: its queues tell the device kind, its controller the slots.
    queues = set(getattr(getattr(sender, "task_consumer", None), "queues", None) or [])
    names = {getattr(q, "name", q) for q in queues}
    slots = getattr(getattr(sender, "controller", None), "concurrency", None) or settings.worker_concurrency
    _heartbeat = Heartbeat(
        sessions=session_factory(settings),
        name=worker_name(),  # what lifecycle.claim writes into jobs.worker
        device="cuda" if queue_for(settings.queue, "cuda") in names else "cpu",
        slots=int(slots),
        interval=settings.worker_heartbeat_seconds,
    )
    _heartbeat.start()


@worker_shutdown.connect
def _stop_reconciler(**_: Any) -> None:
    if _reconciler is not None:
        _reconciler.stopped.set()
    if _heartbeat is not None:
        _heartbeat.stopped.set()
        _heartbeat.join(timeout=5)
