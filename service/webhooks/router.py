"""Thin routes of `/v1/webhooks` (admins only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query, Response, status

from api_schemas import WebhookCreate, WebhookCreated, WebhookDeliveryList, WebhookList
from service.deps import CurrentUser, SessionDep, SettingsDep
from service.errors import Forbidden, NotFound, error_responses
from service.params import Text
from service.routing import v1_router
from service.webhooks import service

router = v1_router("webhooks")
WebhookId = Annotated[Text, Path(max_length=32, description="The webhook's id.")]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=WebhookCreated,
    responses=error_responses(Forbidden),
)
def create_webhook(
    body: WebhookCreate, session: SessionDep, user: CurrentUser, settings: SettingsDep
) -> WebhookCreated:
    """Register a webhook for job state changes; its signing secret is shown in this answer only."""
    return service.create(session, actor=user, body=body, settings=settings)


@router.get("", response_model=WebhookList, responses=error_responses(Forbidden))
def list_webhooks(session: SessionDep, user: CurrentUser) -> WebhookList:
    """Every registered webhook (never its secret)."""
    return service.listed(session, actor=user)


@router.delete(
    "/{webhook_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses=error_responses(Forbidden, NotFound),
)
def delete_webhook(webhook_id: WebhookId, session: SessionDep, user: CurrentUser) -> Response:
    """Remove a webhook; its deliveries not yet sent are dropped."""
    service.delete(session, actor=user, webhook_id=webhook_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get(
    "/{webhook_id}/deliveries",
    response_model=WebhookDeliveryList,
    responses=error_responses(Forbidden, NotFound),
)
def list_deliveries(
    webhook_id: WebhookId,
    session: SessionDep,
    user: CurrentUser,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> WebhookDeliveryList:
    """A webhook's newest deliveries with their last status."""
    return service.deliveries(session, actor=user, webhook_id=webhook_id, limit=limit)
