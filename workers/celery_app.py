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
)


_reconciler: Any = None


@worker_ready.connect
def _start_reconciler(**_: Any) -> None:
    global _reconciler
    from service.db import session_factory
    from service.dispatch import CeleryDispatcher
    from workers.reconciler import Reconciler

    _reconciler = Reconciler(
        sessions=session_factory(settings),
        dispatcher=CeleryDispatcher(settings),
        after_seconds=settings.republish_after_seconds,
        interval=settings.reconcile_interval_seconds,
    )
    _reconciler.start()


@worker_shutdown.connect
def _stop_reconciler(**_: Any) -> None:
    if _reconciler is not None:
        _reconciler.stopped.set()
