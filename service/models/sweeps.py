"""Sweeps and their trials; a trial's job is an ordinary job labelled `sweep=<id>`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Float, ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, utcnow


class Sweep(Base):
    __tablename__ = "sweeps"
    __table_args__ = (
        Index("ix_sweeps_owner_created", "owner_id", "created_at"),
        # The driver's question: the sweeps still running.
        Index("ix_sweeps_state", "state"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    # Written only by service.sweeps.lifecycle.transition().
    state: Mapped[str] = mapped_column(String(16), default="running")
    # The request as accepted (SweepCreate as JSON).
    spec: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    # Why the sweep failed when it was not its trials' doing (a later trial's submit was refused).
    error: Mapped[str | None] = mapped_column(Text, default=None)


class SweepTrial(Base):
    __tablename__ = "sweep_trials"
    # One row per (sweep, number), written in the same transaction as its job: a restarted driver
    # neither loses nor repeats a trial, and of two racing drivers one insert wins.
    __table_args__ = (UniqueConstraint("sweep_id", "number", name="uq_sweep_trials_sweep_number"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    number: Mapped[int]
    job_id: Mapped[str | None] = mapped_column(String(32), default=None)
    params: Mapped[dict[str, Any]]
    # No status of its own: a trial's status is its job's (service.sweeps.service.status_of).
    # The objective, once its job succeeded: kept here because a finished job's metric points are
    # purged with its history (service.jobs.repository.purge_history), and the result must outlive them.
    objective: Mapped[float | None] = mapped_column(Float, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
