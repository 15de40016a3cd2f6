"""The worker's Celery app: same broker settings as the API's publisher, plus worker knobs."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.signals import worker_init, worker_ready, worker_shutdown, worker_shutting_down

from service.config import get_settings
from service.dispatch import celery_config
from service.files import private_umask

log = logging.getLogger(__name__)
settings = get_settings()
app = Celery("dptrain", include=["workers.node.tasks"])
app.conf.update(celery_config(settings))
app.conf.update(
    # The task only supervises torchrun subprocesses, so threads are enough and avoid forking a
    # process that holds SQLAlchemy connections.
    worker_pool="threads",
    worker_hijack_root_logger=False,
    # A broker restart must not end a job that is running fine: keep the task running through a lost
    # connection (its unacked message may be delivered again, and the acceptance refuses that
    # delivery), and reconnect for as long as it takes. See docs/reliability.md.
    worker_cancel_long_running_tasks_on_connection_loss=False,
    broker_connection_max_retries=None,
)


_threads: list[Any] = []


def _ours(sender: Any) -> bool:
    """Whether a worker signal is this app's: Celery's signals fire for every app's worker in the process.

    The webhook sender (service/webhooks/worker.py) is another Celery app; where both are imported (a test
    process, a tool), its worker must not start this node's heartbeat, placement and reconciler, nor
    set the process's umask.
    """
    return getattr(sender, "app", None) is app


@worker_init.connect
def _private_files(sender: Any = None, **_: Any) -> None:
    """Run directories, checkpoints, logs and unpacked code are this worker's alone (umask 077)."""
    # At the worker's start, before any task: the runner's torchrun and every rank inherit it.
    if _ours(sender):
        private_umask()


@worker_ready.connect
def _start_background(sender: Any = None, **_: Any) -> None:
    """Heartbeat, placement and reconciler threads of this worker node."""
    if not _ours(sender):
        return
    from service.db import session_factory
    from service.dispatch import node_dispatcher
    from service.scheduling.scheduler import Scheduler
    from workers.attempt import runner
    from workers.node.heartbeat import Heartbeat, node_address, node_slots
    from workers.node.reconciler import Reconciler, recover_lost
    from workers.pyenv.environments import listed_environments

    device = app.conf.get("dptrain_device", "cpu")
    # Runs of this node still `running` from before this process started are gone with the process
    # that ran them (a crash, or a shutdown that could not record their end): end them now, before
    # placement runs, instead of after a lease (the reconciler's wait for other workers' leases).
    try:
        recover_lost(
            sessions=session_factory(settings),
            lease_seconds=settings.worker_lease_seconds,
            me=settings.node,
            running_here=runner.active(),
            others=False,
        )
    except Exception:  # noqa: BLE001 - e.g. the database still starting: the reconciler does it later
        log.warning("ending this node's runs of an earlier process failed", exc_info=True)
    dispatcher = node_dispatcher(settings)
    scheduler = Scheduler(sessions=session_factory(settings), dispatcher=dispatcher, settings=settings)
    # This node's slots are free again when one of its runs ends: place what waits right away.
    runner.on_release.append(scheduler.kick)
    heartbeat = Heartbeat(
        sessions=session_factory(settings),
        name=settings.node,
        address=node_address(settings),
        device=device,
        slots=node_slots(settings, device),
        interval=settings.worker_heartbeat_seconds,
        on_first_beat=scheduler.kick,
        environments=lambda: listed_environments(settings.env_cache),
    )
    reconciler = Reconciler(
        sessions=session_factory(settings),
        dispatcher=dispatcher,
        settings=settings,
        me=settings.node,
        on_freed=scheduler.kick,
    )
    # The heartbeat last: it keeps this node's leases until its runs have recorded their end.
    _threads[:] = [scheduler, reconciler, heartbeat]
    for thread in _threads:
        thread.start()


@worker_shutting_down.connect
def _stop_runs(**_: Any) -> None:
    """Stop placing, and stop every run's ranks now: Celery's warm shutdown would wait for them."""
    from workers.attempt.watch import stopping

    if not _threads:
        return  # not this node's worker (its sender is only a host name): another app's shutdown
    # Placement first, so nothing is placed back on this node as its runs hand their attempts back.
    for thread in _threads[:-1]:
        _halt(thread)
    stopping.set()


@worker_shutdown.connect
def _stop_background(sender: Any = None, **_: Any) -> None:
    if not _ours(sender):
        return
    for thread in _threads:
        _halt(thread)
    for thread in _threads:
        thread.join(timeout=5)


def _halt(thread: Any) -> None:
    # The scheduler's stop() also wakes it from its wait between rounds; the others wait on `stopped`.
    getattr(thread, "stop", thread.stopped.set)()
