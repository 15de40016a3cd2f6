"""Thin routes of `/v1/users`."""

from __future__ import annotations

from fastapi import Response, status

from api_schemas import IssuedToken, UserCreate, UserInfo
from api_schemas.users import UserUpdate
from service.deps import CurrentUser, SessionDep, SettingsDep
from service.errors import (
    Conflict,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    error_responses,
)
from service.params import UserPath
from service.routing import v1_router
from service.users import service

router = v1_router("users")


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=IssuedToken,
    responses=error_responses(Forbidden, Conflict, PayloadTooLarge),
)
def create_user(body: UserCreate, session: SessionDep, user: CurrentUser) -> IssuedToken:
    """Create a user (admins only) and return its first token, shown this once."""
    return service.create_by(
        session, actor=user, name=body.name, admin=body.admin, can_run_code=body.can_run_code
    )


@router.get("/me", response_model=UserInfo)
def who_am_i(user: CurrentUser) -> UserInfo:
    """The user this token belongs to."""
    return service.to_info(user)


@router.patch("/{name}/permissions", response_model=UserInfo, responses=error_responses(Forbidden, NotFound))
def update_user(name: UserPath, body: UserUpdate, session: SessionDep, user: CurrentUser) -> UserInfo:
    """Change what a user may do (admins only); fields left out stay as they are."""
    return service.grant(
        session, actor=user, name=name, can_run_code=body.can_run_code, max_priority=body.max_priority
    )


@router.post(
    "/{name}/tokens",
    status_code=status.HTTP_201_CREATED,
    response_model=IssuedToken,
    responses=error_responses(NotFound, Conflict),
)
def issue_token(name: UserPath, session: SessionDep, user: CurrentUser, settings: SettingsDep) -> IssuedToken:
    """Issue another token for a user (admins: anyone; users: themselves), shown this once."""
    return service.issue_token(session, actor=user, name=name, max_tokens=settings.max_tokens_per_user)


@router.delete(
    "/{name}/tokens",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses=error_responses(NotFound),
)
def revoke_tokens(name: UserPath, session: SessionDep, user: CurrentUser) -> Response:
    """Revoke every token of a user at once (admins: anyone; users: themselves)."""
    service.revoke_tokens(session, actor=user, name=name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
