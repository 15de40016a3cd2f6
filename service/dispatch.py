"""Sending node starts to Celery by task name: the API never imports the worker code (nor torch)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from celery import Celery

from service.config import Settings
from service.files import create_private_sqlite

log = logging.getLogger(__name__)

RUN_NODE_TASK = "dptrain.run_node"

# kombu's own retry around one publish (Connection.ensure): on a connection error it opens the
# connection again and publishes after 0, 1 and 2 s. A blip costs a publish a few seconds; a broker
# that stays down fails it, and BackgroundDispatcher keeps the start for its next try.
PUBLISH_RETRY_POLICY: dict[str, Any] = {
    "max_retries": 3,
    "interval_start": 0,
    "interval_step": 1,
    "interval_max": 2,
}
# How often starts whose publish failed are tried again: a node placed while the broker was down
# starts within seconds of its return. A start that was published and then lost (a broker that
# dropped it, a worker that died holding it) is sent again only by the reconciler, after
# DPTRAIN_REPUBLISH_AFTER_SECONDS: nothing in this process can tell it apart from a slow start.
RESEND_SECONDS = 3.0


def celery_config(settings: Settings) -> dict[str, object]:
    """Celery settings shared by the publisher (API) and the consumer (worker); see docs/architecture.md."""
    # Both read this before kombu opens the embedded queue's SQLite file: created private here, as
    # the transport itself would create it with the process's umask.
    create_private_sqlite(settings.broker_url)
    return {
        "broker_url": settings.broker_url,
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,
        # A message only starts one placed node; SQL holds the job and the placement, not the
        # broker. So it is acknowledged on receipt: a worker that dies is found by its lease, and a
        # start it never accepted is sent again (republish_unstarted). No delivery stays unacked
        # for a run's hours, which RabbitMQ's consumer_timeout and kombu's Redis reconnect (its
        # restore of unacked messages crashed the worker on a Redis restart) both punish.
        "task_acks_late": False,
        "worker_prefetch_multiplier": 1,
        "broker_transport_options": _transport_options(settings.broker_url),
        "broker_connection_retry_on_startup": True,
    }


def node_queue(base: str, node: str) -> str:
    """The queue of one worker node: placement decides the node, the broker only carries the message."""
    return f"{base}.node.{node}"


def _transport_options(broker_url: str) -> dict[str, object]:
    if broker_url.startswith(("redis://", "rediss://")):
        # Redis redelivers an unacked message after the visibility timeout: it must exceed the
        # longest job, else a healthy run is delivered again (the claim would refuse it anyway).
        return {"visibility_timeout": 7 * 24 * 3600}
    # kombu's SQLAlchemy transport hands its options to create_engine, so it gets none.
    return {}


@dataclass(frozen=True)
class NodeStart:
    """Start node `node_rank` of attempt `attempt` of a job on worker node `worker`.

    `endpoint` is the c10d rendezvous of a multi-node attempt (node 0's "address:port"), "" for one node.
    """

    job_id: str
    attempt: int
    node_rank: int
    worker: str
    endpoint: str = ""


class Dispatcher(Protocol):
    def start_node(self, start: NodeStart) -> None: ...


class CeleryDispatcher:
    """Sends `dptrain.run_node(job_id, attempt, node_rank, endpoint)` to the chosen node's own queue."""

    def __init__(self, settings: Settings) -> None:
        self.queue = settings.queue
        self.app = Celery("dptrain-api")
        self.app.conf.update(celery_config(settings))

    def start_node(self, start: NodeStart) -> None:
        """Publish one node start, ids only (Celery's own advice); raises if the broker stays down."""
        self.app.send_task(
            RUN_NODE_TASK,
            args=[start.job_id, start.attempt, start.node_rank, start.endpoint],
            queue=node_queue(self.queue, start.worker),
            retry=True,
            retry_policy=PUBLISH_RETRY_POLICY,
        )


class BackgroundDispatcher:
    """Publishes node starts from a thread of its own; a start whose publish failed is kept and tried
    again every `resend_seconds` until it goes out.

    So no placement round (nor the reconciler) waits on a broker that is down, and a node placed
    meanwhile starts soon after the broker's return rather than at the reconciler's republish.
    Held in memory: starts a process dies with are the reconciler's to send again. A start sent
    twice is harmless (a node starts only through a conditional UPDATE, scheduling.repository.accept).
    """

    def __init__(self, inner: Dispatcher, *, resend_seconds: float = RESEND_SECONDS) -> None:
        self.inner, self.resend_seconds = inner, resend_seconds
        self._due: dict[tuple[str, int, int], NodeStart] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start_node(self, start: NodeStart) -> None:
        """Hand one node start to the sender thread; never blocks on the broker."""
        with self._lock:
            # One per node of an attempt: the reconciler's resend of a start still due here adds nothing.
            self._due.setdefault((start.job_id, start.attempt, start.node_rank), start)
            if self._thread is None:  # started on first use: an app built by a test may never send
                self._thread = threading.Thread(target=self._run, name="dptrain-start-sender", daemon=True)
                self._thread.start()
        self._wake.set()

    def due(self) -> list[NodeStart]:
        """The starts not sent yet, oldest first."""
        with self._lock:
            return list(self._due.values())

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while not self._send_due():
                # The broker is down: starts placed meanwhile join the next try, not one each. A loop
                # of ours around kombu's bounded retry, not kombu's retry forever: a start refused for
                # another reason than the connection would leave kombu's at once, and be lost.
                time.sleep(self.resend_seconds)

    def _send_due(self) -> bool:
        """Publish every due start, oldest first; False when one failed (it and the rest wait)."""
        sent = 0
        for start in self.due():
            key = (start.job_id, start.attempt, start.node_rank)
            try:
                self.inner.start_node(start)
            except Exception:  # noqa: BLE001 - the broker unreachable, or refusing: try again later
                with self._lock:  # last in line: one start the broker keeps refusing holds up no other
                    if key in self._due:
                        self._due[key] = self._due.pop(key)
                if not self._failing:
                    log.warning(
                        "sending node starts failed; %d wait, tried again every %g s",
                        len(self.due()),
                        self.resend_seconds,
                        exc_info=True,
                    )
                self._failing = True
                return False
            with self._lock:
                self._due.pop(key, None)
            sent += 1
        if self._failing:
            log.info("sending node starts works again: sent %d", sent)
            self._failing = False
        return True


def node_dispatcher(settings: Settings) -> Dispatcher:
    """How placement and the reconciler send node starts in the API and worker processes."""
    return BackgroundDispatcher(CeleryDispatcher(settings))
