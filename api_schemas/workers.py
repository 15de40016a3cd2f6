"""Workers as the service knows them from their heartbeats."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field


class CachedEnvironment(BaseModel):
    """A job environment a worker node has built and keeps (least recently used evicted first)."""

    key: str = Field(
        description="sha256 of its requirements and the worker's Python, torch, package sources."
    )
    bytes: int
    build_seconds: float
    used_at: datetime = Field(description="When an attempt last used it.")


class Worker(BaseModel):
    """One worker node: what it runs on, how busy it is, when it last reported."""

    name: str = Field(
        description="The node name (DPTRAIN_NODE_NAME). Non-admins see `node-<12 hex>` instead where the "
        "name would give away the host name or address (by default it is the host name)."
    )
    hostname: str | None = Field(description="The host's name; null for non-admins.")
    address: str | None = Field(
        description="Where other nodes reach it (rendezvous, collectives); null for non-admins."
    )
    device: Literal["cpu", "cuda"]
    device_count: int = Field(description="GPUs for a cuda worker, logical CPU cores for a cpu worker.")
    slots: int = Field(description="Rank processes it runs at once; a job takes `processes_per_node`.")
    free_slots: int = Field(description="Slots no running job holds (a lost node's stay held until ended).")
    running_jobs: list[str]
    last_heartbeat: datetime
    heartbeat_age_seconds: float
    status: Literal["alive", "lost"] = Field(description="`lost` once 3 heartbeats are missed.")
    cached_environments: list[CachedEnvironment] = Field(
        default_factory=list, description="The job environments it has built and keeps, as of its last beat."
    )


class WorkerList(BaseModel):
    items: list[Worker]
