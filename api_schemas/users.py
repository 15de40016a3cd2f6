"""Users and their API tokens on the wire."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from api_schemas.base import MAX_PRIORITY, Strict

UserName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
]


class UserCreate(Strict):
    """What an admin sends to `POST /v1/users`."""

    # Strict: `"admin": 0` or `"admin": "yes"` is refused rather than read as a boolean.
    model_config = ConfigDict(extra="forbid", strict=True)

    name: UserName
    admin: bool = Field(False, description="Admins see and manage every job and create users.")
    can_run_code: bool = Field(
        False, description="May upload code and run jobs with an entrypoint or a command (admins always may)."
    )


class UserUpdate(Strict):
    """What an admin sends to `PATCH /v1/users/{name}`: the fields to change."""

    model_config = ConfigDict(extra="forbid", strict=True)

    can_run_code: bool | None = Field(None, description="Grant or withdraw running user code.")
    max_priority: int | None = Field(
        None, ge=0, le=MAX_PRIORITY, description="The highest job `priority` the user may submit (default 0)."
    )


class UserInfo(BaseModel):
    """Who a user is (never their tokens)."""

    name: str
    admin: bool
    can_run_code: bool
    max_priority: int = Field(
        0, description="The highest job `priority` they may submit, as granted; admins may submit up to 1000."
    )
    created_at: datetime


class IssuedToken(BaseModel):
    """A new bearer token: shown this once, stored only as its sha256."""

    name: str
    admin: bool
    can_run_code: bool
    token: str = Field(description="Send as `Authorization: Bearer <token>`; it is not shown again.")
