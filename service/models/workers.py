"""Workers as the service knows them: one row per worker process, refreshed by its heartbeat."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, utcnow


class Worker(Base):
    __tablename__ = "workers"

    # The same `host:pid` the worker writes into `jobs.worker` when it claims a job.
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    device: Mapped[str] = mapped_column(String(8))
    device_count: Mapped[int]
    slots: Mapped[int]
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(default=utcnow)
