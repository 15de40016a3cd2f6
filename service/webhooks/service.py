"""Registering webhooks (admins only) and reading what was delivered to them."""

from __future__ import annotations

import uuid

from sqlalchemy.orm import Session

from api_schemas import (
    WebhookCreate,
    WebhookCreated,
    WebhookDelivery,
    WebhookDeliveryList,
    WebhookInfo,
    WebhookList,
)
from service.config import Settings
from service.errors import Forbidden, NotFound, invalid_field
from service.models import User, Webhook
from service.models.base import utcnow
from service.users import repository as users
from service.webhooks import repository, urls
from service.webhooks.signing import new_secret


def _admin(actor: User) -> None:
    if not actor.is_admin:
        raise Forbidden("only an admin can manage webhooks")


def create(session: Session, *, actor: User, body: WebhookCreate, settings: Settings) -> WebhookCreated:
    """Register a webhook after checking where its URL leads; its secret is in this answer only."""
    _admin(actor)
    try:
        urls.checked(body.url, allow=urls.allowed_networks(settings.webhook_allow_networks))
    except urls.UnsafeUrl as exc:
        raise invalid_field(("body", "url"), str(exc), body.url) from None
    owner = None
    if body.owner is not None:
        owner = users.by_name(session, name=body.owner)
        if owner is None:
            raise invalid_field(("body", "owner"), f"no user named {body.owner!r}", body.owner)
    events = None if body.events == "all" else sorted(set(body.events))
    hook = Webhook(
        id=uuid.uuid4().hex,
        url=body.url,
        events=events,
        owner_id=owner.id if owner else None,
        secret=new_secret(),
        created_by=actor.id,
        created_at=utcnow(),
    )
    repository.add(session, webhook=hook)
    info = _info(hook, owner.name if owner else None)
    return WebhookCreated(**info.model_dump(), secret=hook.secret)


def listed(session: Session, *, actor: User) -> WebhookList:
    """Every webhook, without secrets."""
    _admin(actor)
    return WebhookList(items=[_info(hook, owner) for hook, owner in repository.listed(session)])


def delete(session: Session, *, actor: User, webhook_id: str) -> None:
    """Remove a webhook; its pending deliveries are dropped with it."""
    _admin(actor)
    if not repository.remove(session, webhook_id=webhook_id):
        raise NotFound(f"no webhook {webhook_id}")


def deliveries(session: Session, *, actor: User, webhook_id: str, limit: int) -> WebhookDeliveryList:
    """A webhook's newest deliveries, each with its last attempt."""
    _admin(actor)
    if repository.by_id(session, webhook_id=webhook_id) is None:
        raise NotFound(f"no webhook {webhook_id}")
    rows = repository.deliveries(session, webhook_id=webhook_id, limit=limit)
    return WebhookDeliveryList(
        items=[
            WebhookDelivery.model_validate(
                {
                    "id": d.id,
                    "job_id": d.job_id,
                    "event": d.event,
                    "status": d.status,
                    "attempts": d.attempts,
                    "last_status_code": d.last_status_code,
                    "last_error": d.last_error,
                    "last_attempt_at": d.last_attempt_at,
                    "next_attempt_at": d.next_attempt_at if d.status == "pending" else None,
                    "delivered_at": d.delivered_at,
                    "created_at": d.created_at,
                    "payload": d.payload,
                }
            )
            for d in rows
        ]
    )


def _info(hook: Webhook, owner: str | None) -> WebhookInfo:
    return WebhookInfo.model_validate(
        {
            "id": hook.id,
            "url": hook.url,
            "events": "all" if hook.events is None else hook.events,
            "owner": owner,
            "created_at": hook.created_at,
        }
    )
