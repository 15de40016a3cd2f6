"""Worker nodes as the service knows them (from their heartbeats) and where running jobs are placed."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, ForeignKey, Index, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, utcnow


class Worker(Base):
    __tablename__ = "workers"

    # The node name (DPTRAIN_NODE_NAME, by default the host name): its Celery queue is
    # `<queue>.node.<name>`, and placement writes it into `jobs.worker` and `job_nodes.worker`.
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    # Where other nodes reach this one: the rendezvous of a job whose node 0 it is, and its ranks.
    address: Mapped[str] = mapped_column(String(255), default="")
    device: Mapped[str] = mapped_column(String(8))
    device_count: Mapped[int]
    # Rank processes this node runs at once; a job on it takes `processes_per_node` of them.
    slots: Mapped[int]
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(default=utcnow)
    # The job environments this node has cached (workers/pyenv/environments.cached), as of its last beat.
    environments: Mapped[list[dict[str, Any]] | None] = mapped_column(default=None)


class JobNode(Base):
    """One node of a running job's placement: written by placement, removed when the attempt ends."""

    __tablename__ = "job_nodes"
    __table_args__ = (
        Index("ix_job_nodes_worker", "worker"),
        UniqueConstraint("port", name="uq_job_nodes_port"),
    )

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    node_rank: Mapped[int] = mapped_column(primary_key=True)
    attempt: Mapped[int]
    worker: Mapped[str] = mapped_column(String(255))
    slots: Mapped[int]
    address: Mapped[str] = mapped_column(String(255))
    # The c10d rendezvous port, on node 0 of a multi-node job (its address is the endpoint).
    port: Mapped[int | None] = mapped_column(default=None)
    # The uid a multi-node attempt's ranks run as on every node, on each of its rows: placement gives
    # it from DPTRAIN_CLUSTER_RANK_UID_RANGE, none other running holds it (None for one node).
    rank_uid: Mapped[int | None] = mapped_column(BigInteger, default=None)
    placed_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Set when the node's worker accepted its message and started torchrun.
    started_at: Mapped[datetime | None] = mapped_column(default=None)
