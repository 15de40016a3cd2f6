"""Sending node starts to Celery by task name: the API never imports the worker code (nor torch)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from celery import Celery

from service.config import Settings
from service.files import create_private_sqlite

log = logging.getLogger(__name__)

RUN_NODE_TASK = "dptrain.run_node"


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
        """Publish one node start; ids only, never objects (Celery's own advice)."""
        self.app.send_task(
            RUN_NODE_TASK,
            args=[start.job_id, start.attempt, start.node_rank, start.endpoint],
            queue=node_queue(self.queue, start.worker),
        )
