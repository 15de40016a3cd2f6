"""Stack dumps of a job's ranks (py-spy, read by their worker) and the requests for one."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, BigId


class StackRequest(Base):
    """A user asked for the stacks of a running job: its worker's next report sees it and dumps them."""

    __tablename__ = "stack_requests"

    # A table of its own rather than a column of `jobs`: a request must not touch the job's row,
    # whose updated_at ETags and event streams follow.
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    requested_at: Mapped[datetime]


class RankStacks(Base):
    """One node's dump of every thread of every rank of an attempt (api_schemas.StackDump as JSON)."""

    __tablename__ = "rank_stacks"
    __table_args__ = (Index("ix_rank_stacks_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    node: Mapped[str] = mapped_column(String(255))
    reason: Mapped[str] = mapped_column(String(32))
    # The request this dump answers (its `requested_at`); NULL for a dump the attempt's end took.
    requested_at: Mapped[datetime | None]
    taken_at: Mapped[datetime]
    dump: Mapped[dict[str, Any]]
