"""The worker's Celery app: same broker settings as the API's publisher, plus worker knobs."""

from __future__ import annotations

from celery import Celery

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
