"""Webhooks and their outbox: a delivery row per (state change, webhook), written with the change."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ForeignKey, Index, SmallInteger, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, JSONType, utcnow


class Webhook(Base):
    __tablename__ = "webhooks"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    url: Mapped[str] = mapped_column(Text)
    # The job states sent (a JSON list), null for all.
    events: Mapped[list[str] | None] = mapped_column(JSONType, default=None)
    # Only this user's jobs; null: every job.
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    # The HMAC key: kept in clear because signing needs it (docs/security.md).
    secret: Mapped[str] = mapped_column(String(128))
    created_by: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookDelivery(Base):
    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        # The sweep's question: the pending deliveries that are due.
        Index(
            "ix_webhook_deliveries_due",
            "next_attempt_at",
            postgresql_where=text("status = 'pending'"),
            sqlite_where=text("status = 'pending'"),
        ),
        # A webhook's deliveries, newest first.
        Index("ix_webhook_deliveries_webhook", "webhook_id", "created_at"),
    )

    # Sent as the Dptrain-Delivery header: the same on every retry, so receivers drop duplicates.
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    webhook_id: Mapped[str] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    job_id: Mapped[str] = mapped_column(String(32))
    event: Mapped[str] = mapped_column(String(16))
    payload: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(default=0)
    last_status_code: Mapped[int | None] = mapped_column(SmallInteger, default=None)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    last_attempt_at: Mapped[datetime | None] = mapped_column(default=None)
    next_attempt_at: Mapped[datetime | None] = mapped_column(default=None)
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
