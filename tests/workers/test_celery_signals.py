"""The node worker's Celery signals act for its own app only: another app's worker is not a node."""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import worker_init, worker_ready, worker_shutdown

from workers.node import celery_app


class _Worker:
    """What Celery sends its worker signals from: something with an `app` (hashable, as Celery needs)."""

    def __init__(self, app: Celery) -> None:
        self.app = app


def test_another_apps_worker_sets_no_umask_and_starts_no_node_threads() -> None:
    other = _Worker(Celery("someone-else"))
    before = os.umask(0o022)
    try:
        worker_init.send(sender=other)
        worker_ready.send(sender=other)
        worker_shutdown.send(sender=other)
        assert os.umask(0o022) == 0o022, "another app's worker changed this process's umask"
    finally:
        os.umask(before)
    assert celery_app._threads == [], "another app's worker started the node's background threads"


def test_the_node_apps_own_worker_is_recognised() -> None:
    assert celery_app._ours(_Worker(celery_app.app))
    assert not celery_app._ours(_Worker(Celery("someone-else")))
    assert not celery_app._ours("a-host-name")
