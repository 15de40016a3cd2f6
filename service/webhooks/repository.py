"""Queries of webhooks and their deliveries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from service.models import User, Webhook, WebhookDelivery


def add(session: Session, *, webhook: Webhook) -> None:
    """Store a new webhook."""
    session.add(webhook)
    session.flush()


def listed(session: Session) -> Sequence[tuple[Webhook, str | None]]:
    """Every webhook with its owner's name, oldest first."""
    stmt = (
        select(Webhook, User.name)
        .outerjoin(User, User.id == Webhook.owner_id)
        .order_by(Webhook.created_at, Webhook.id)
    )
    return [(hook, name) for hook, name in session.execute(stmt)]


def by_id(session: Session, *, webhook_id: str) -> Webhook | None:
    """One webhook, or None."""
    return session.get(Webhook, webhook_id)


def remove(session: Session, *, webhook_id: str) -> bool:
    """Delete a webhook and its deliveries (pending ones are not sent); False if there was none."""
    session.execute(delete(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id))
    return session.execute(delete(Webhook).where(Webhook.id == webhook_id)).rowcount > 0  # type: ignore[attr-defined]


def deliveries(session: Session, *, webhook_id: str, limit: int) -> Sequence[WebhookDelivery]:
    """A webhook's newest deliveries first."""
    stmt = (
        select(WebhookDelivery)
        .where(WebhookDelivery.webhook_id == webhook_id)
        .order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id.desc())
        .limit(limit)
    )
    return session.scalars(stmt).all()


def pending_url(session: Session, *, delivery_id: str) -> str | None:
    """The URL a pending delivery goes to; None if it is delivered, failed or gone."""
    stmt = (
        select(Webhook.url)
        .join(WebhookDelivery, WebhookDelivery.webhook_id == Webhook.id)
        .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status == "pending")
    )
    return session.scalar(stmt)


@dataclass(frozen=True)
class Claimed:
    """A delivery this sender holds until `lease` ends: what to send, and where."""

    id: str
    attempts: int
    event: str
    payload: dict[str, Any]
    url: str
    secret: str


def claim(session: Session, *, delivery_id: str, now: datetime, lease_seconds: float) -> Claimed | None:
    """Take a due pending delivery for one attempt (a guarded UPDATE); None if it is not due or not pending.

    The lease keeps a second sender (a duplicate task, the sweep) off it while this one sends; a sender
    that dies leaves it due again once the lease ends.
    """
    stmt = (
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == delivery_id,
            WebhookDelivery.status == "pending",
            WebhookDelivery.next_attempt_at <= now,
        )
        .values(
            attempts=WebhookDelivery.attempts + 1,
            last_attempt_at=now,
            next_attempt_at=now + timedelta(seconds=lease_seconds),
        )
        .returning(
            WebhookDelivery.webhook_id,
            WebhookDelivery.attempts,
            WebhookDelivery.event,
            WebhookDelivery.payload,
        )
    )
    row = session.execute(stmt).one_or_none()
    if row is None:
        return None
    hook = session.get(Webhook, row.webhook_id)
    if hook is None:
        return None
    return Claimed(
        id=delivery_id,
        attempts=row.attempts,
        event=row.event,
        payload=row.payload,
        url=hook.url,
        secret=hook.secret,
    )


def record_attempt(
    session: Session,
    *,
    claimed: Claimed,
    now: datetime,
    status_code: int | None,
    error: str | None,
    retry_at: datetime | None,
) -> None:
    """The outcome of a claimed attempt: delivered (no error), pending until `retry_at`, or failed."""
    if error is None:
        values: dict[str, Any] = {"status": "delivered", "delivered_at": now, "next_attempt_at": None}
    elif retry_at is not None:
        values = {"next_attempt_at": retry_at}
    else:
        values = {"status": "failed", "next_attempt_at": None}
    # Guarded by the attempt: a sender whose lease ran out must not undo a later sender's outcome.
    session.execute(
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == claimed.id,
            WebhookDelivery.status == "pending",
            WebhookDelivery.attempts == claimed.attempts,
        )
        .values(last_status_code=status_code, last_error=error, **values)
    )


def due(session: Session, *, now: datetime, limit: int) -> list[str]:
    """Pending deliveries whose next attempt is due, oldest first."""
    stmt = (
        select(WebhookDelivery.id)
        .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
    )
    return list(session.scalars(stmt))
