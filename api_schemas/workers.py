"""Workers as the service knows them from their heartbeats."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field


class Worker(BaseModel):
    """One worker process: what it runs on, how busy it is, when it last reported."""

    name: str = Field(description="`host:pid`, as in the jobs it runs.")
    hostname: str
    device: Literal["cpu", "cuda"]
    device_count: int = Field(description="GPUs for a cuda worker, logical CPU cores for a cpu worker.")
    slots: int = Field(description="Jobs it runs at once (its concurrency).")
    free_slots: int
    running_jobs: list[str]
    last_heartbeat: datetime
    heartbeat_age_seconds: float
    status: Literal["alive", "lost"] = Field(description="`lost` once 3 heartbeats are missed.")


class WorkerList(BaseModel):
    items: list[Worker]
