"""Webhooks on the wire: endpoints that receive every job state change, and their deliveries."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from api_schemas.base import Strict
from api_schemas.jobs import JobStatus
from api_schemas.users import UserName

StateName = Literal["queued", "running", "succeeded", "failed", "cancelled"]
WebhookUrl = Annotated[str, StringConstraints(min_length=1, max_length=2048)]


class WebhookCreate(Strict):
    """What an admin sends to `POST /v1/webhooks`."""

    url: WebhookUrl = Field(
        description="An http(s) URL; not the service itself nor a link-local or metadata address "
        "(unless DPTRAIN_WEBHOOK_ALLOW_NETWORKS allows it)."
    )
    # Strict models take an enum only as itself; the states' names are what a client sends.
    events: Literal["all"] | Annotated[list[StateName], Field(min_length=1, max_length=5)] = Field(
        "all", description="The job states whose entry is sent (`to` of a change), or `all`."
    )
    owner: UserName | None = Field(
        None, description="Only this user's jobs; leave out for every job (a global webhook)."
    )


class WebhookInfo(BaseModel):
    """A registered webhook (never its secret)."""

    id: str
    url: str
    events: Literal["all"] | list[StateName]
    owner: str | None = Field(description="The user whose jobs it receives; null: every job.")
    created_at: datetime


class WebhookCreated(WebhookInfo):
    """A new webhook with its signing secret, shown this once."""

    secret: str = Field(description="The HMAC-SHA256 key of its signatures; it is not shown again.")


class WebhookList(BaseModel):
    items: list[WebhookInfo]


class WebhookDelivery(BaseModel):
    """One job state change sent (or to be sent) to one webhook, with its last attempt."""

    id: str = Field(description="Sent as `Dptrain-Delivery`; the same on every retry of this change.")
    job_id: str
    event: JobStatus = Field(description="The state the job entered.")
    status: Literal["pending", "delivered", "failed"] = Field(
        description="`pending` until a 2xx answer (retried with backoff), `failed` after the last attempt."
    )
    attempts: int
    last_status_code: int | None = Field(description="The HTTP status of the last attempt, if it got one.")
    last_error: str | None = Field(description="Why the last attempt failed, if it did.")
    last_attempt_at: datetime | None
    next_attempt_at: datetime | None = Field(description="When a pending delivery is tried next.")
    delivered_at: datetime | None
    created_at: datetime
    payload: dict[str, Any]


class WebhookDeliveryList(BaseModel):
    items: list[WebhookDelivery]
