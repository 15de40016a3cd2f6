"""The outbox: delivery rows written in the transaction of each job state change, sent after its commit.

A change that commits has its deliveries committed with it, so nothing accepted is lost; one that
rolls back leaves none. After the commit the ids go to the process's publisher (a Celery message each,
sent from a thread of its own, so no commit waits for the broker); a lost message is found by the
webhook worker's sweep (`service.webhooks.sweep`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, event, insert, or_, select
from sqlalchemy.orm import Session, SessionTransaction

from service.models import User, Webhook, WebhookDelivery

# session.info keys: the ids written in the open transaction, and the publisher of the session's factory.
PENDING = "dptrain.webhook_deliveries"
PUBLISHER = "dptrain.webhook_publisher"


# Built once: constructing the statement anew cost as much as running it.
_WANTED = select(Webhook.id, Webhook.events, Webhook.owner_id).where(
    or_(Webhook.owner_id.is_(None), Webhook.owner_id.in_(bindparam("owners", expanding=True)))
)


@dataclass(frozen=True)
class Change:
    """One job state change, as webhooks receive it."""

    job_id: str
    owner_id: int
    name: str
    src: str | None
    dst: str
    reason: str | None
    at: datetime
    attempt: int
    error: Any = None


def record(session: Session, changes: Sequence[Change]) -> None:
    """A pending delivery for each change and each webhook that wants it, in the caller's transaction."""
    if not changes:
        return
    owners = {c.owner_id for c in changes}
    # One small query per change when no webhook exists (a hot path: every submit and placement);
    # the rest only when some do.
    hooks = session.execute(_WANTED, {"owners": list(owners)}).all()
    if not hooks:
        return
    users = session.execute(select(User.id, User.name).where(User.id.in_(owners)))
    names = {user_id: name for user_id, name in users}
    rows: list[dict[str, Any]] = []
    for change in changes:
        for hook_id, events, owner_id in hooks:
            if owner_id is not None and owner_id != change.owner_id:
                continue
            if isinstance(events, list) and change.dst not in events:
                continue
            delivery_id = uuid.uuid4().hex
            rows.append(
                {
                    "id": delivery_id,
                    "webhook_id": hook_id,
                    "job_id": change.job_id,
                    "event": change.dst,
                    "payload": payload(change, delivery_id=delivery_id, owner=names.get(change.owner_id)),
                    "status": "pending",
                    "attempts": 0,
                    "next_attempt_at": change.at,
                    "created_at": change.at,
                }
            )
    if rows:
        session.execute(insert(WebhookDelivery), rows)
        session.info.setdefault(PENDING, []).extend(r["id"] for r in rows)


def payload(change: Change, *, delivery_id: str, owner: str | None) -> dict[str, Any]:
    """The JSON body of a delivery (docs/api.md#webhooks)."""
    return {
        "type": "job.state_changed",
        "delivery_id": delivery_id,
        "job_id": change.job_id,
        "owner": owner,
        "name": change.name,
        "from": change.src,
        "to": change.dst,
        "reason": change.reason,
        "at": change.at.isoformat(),
        "attempt": change.attempt,
        "error": change.error,
    }


@event.listens_for(Session, "after_commit")
def _publish(session: Session) -> None:
    ids: list[str] | None = session.info.pop(PENDING, None)
    publish: Callable[[list[str]], None] | None = session.info.get(PUBLISHER)
    if ids and publish is not None:
        publish(ids)


@event.listens_for(Session, "after_transaction_end")
def _forget(session: Session, transaction: SessionTransaction) -> None:
    # After the commit's publish; and a rollback, or a close without a commit (which fires no
    # after_rollback), leaves no ids of rows that do not exist for the session's next commit.
    if transaction.parent is None:
        session.info.pop(PENDING, None)
