"""Request dependencies as Annotated aliases; routes just declare them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service.auth.tokens import hash_token
from service.config import Settings
from service.errors import TooManyRequests, Unauthorized
from service.limits import TokenBuckets
from service.models import User
from service.scheduling.scheduler import Kicker
from service.users.repository import user_for_token_hash

log = logging.getLogger(__name__)


def get_settings_dep(request: Request) -> Settings:
    """The app's settings."""
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    """A session whose transaction the request owns: commit at the end, rollback on error.

    Callbacks queued in `session.info["after_commit"]` (kicking placement) run only after the
    commit succeeded, so placement never looks for a job whose row is not there yet.
    """
    session: Session = request.app.state.session_factory()
    try:
        yield session
        session.commit()
        callbacks: list[Callable[[], None]] = session.info.pop("after_commit", [])
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001
                # The job row is committed, so the submit still succeeds: the next periodic
                # placement round finds the queued job anyway.
                log.exception("after-commit callback failed")
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def get_scheduler(request: Request) -> Kicker:
    """The placement thread of this API process, kicked when a job is submitted."""
    scheduler: Kicker = request.app.state.scheduler
    return scheduler


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
# scope="function": commit (and kick placement) before the response is sent, so a 201 means committed.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SchedulerDep = Annotated[Kicker, Depends(get_scheduler)]

_bearer = HTTPBearer(auto_error=False)


def get_current_user(
    request: Request,
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> User:
    """The user of the bearer token, or 401; 429 once the token spent its rate limit."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise Unauthorized()
    digest = hash_token(credentials.credentials)
    # Counted before the lookup, so a flood with one (even invalid) token costs no database work.
    limiter: TokenBuckets = request.app.state.rate_limiter
    wait = limiter.take(digest)
    if wait is not None:
        raise TooManyRequests("rate limit of this token exceeded", retry_after=wait)
    user = user_for_token_hash(session, token_hash=digest)
    if user is None:
        raise Unauthorized()
    return user


CurrentUser = Annotated[User, Depends(get_current_user)]


def after_commit(session: Session, callback: Callable[[], None]) -> None:
    """Run `callback` once this request's transaction has committed."""
    session.info.setdefault("after_commit", []).append(callback)
