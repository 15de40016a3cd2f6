"""The rules of the users domain: who may create users and issue or revoke tokens. Services only flush."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api_schemas import IssuedToken, UserInfo
from service.auth.cache import forget_user_on_commit
from service.auth.tokens import hash_token, new_token
from service.errors import Conflict, Forbidden, NotFound
from service.models import User
from service.models.base import utcnow
from service.users import repository


def to_info(user: User) -> UserInfo:
    """The wire form of a user."""
    return UserInfo(
        name=user.name,
        admin=user.is_admin,
        can_run_code=user.can_run_code,
        max_priority=user.max_priority,
        created_at=user.created_at,
    )


def create(session: Session, *, name: str, admin: bool, can_run_code: bool = False) -> IssuedToken:
    """Create a user with a first token (the token is returned here and never again); Conflict if taken."""
    # Looked up first to name the existing user (`alice` when `Alice` is asked for); the insert
    # still refuses a name taken meanwhile.
    taken = repository.by_name(session, name=name)
    if taken is not None and taken.name != name:
        raise Conflict(f"user {name!r} already exists as {taken.name!r} (names ignore case)")
    user = None if taken else repository.create(session, name=name, is_admin=admin, can_run_code=can_run_code)
    if user is None:
        raise Conflict(f"user {name!r} already exists")
    return _issue(session, user=user)


def create_by(
    session: Session, *, actor: User, name: str, admin: bool, can_run_code: bool = False
) -> IssuedToken:
    """`create` on behalf of `actor`, who must be an admin."""
    if not actor.is_admin:
        raise Forbidden("only an admin can create users")
    return create(session, name=name, admin=admin, can_run_code=can_run_code)


def grant(
    session: Session,
    *,
    actor: User | None,
    name: str,
    can_run_code: bool | None,
    max_priority: int | None = None,
) -> UserInfo:
    """Change running user code or the priority ceiling, None leaving it (admins, or the CLI: actor None)."""
    if actor is not None and not actor.is_admin:
        raise Forbidden("only an admin can change what a user may do")
    user = _target(session, actor=actor, name=name)
    changed = False
    if can_run_code is not None and can_run_code != user.can_run_code:
        repository.set_can_run_code(session, user_id=user.id, allowed=can_run_code)
        changed = True
    if max_priority is not None and max_priority != user.max_priority:
        repository.set_max_priority(session, user_id=user.id, ceiling=max_priority)
        changed = True
    if changed:
        # This process's token cache holds the user as they were: look them up again after the commit.
        forget_user_on_commit(session, user.id)
        session.refresh(user)
    return to_info(user)


def _issue(session: Session, *, user: User, max_tokens: int | None = None) -> IssuedToken:
    if max_tokens is not None and repository.live_token_count(session, user_id=user.id) >= max_tokens:
        # Each token is a credential to revoke one day: a cap keeps that list short and bounded.
        raise Conflict(
            f"user {user.name!r} already has {max_tokens} live tokens (DPTRAIN_MAX_TOKENS_PER_USER); "
            f"revoke them (DELETE /v1/users/{user.name}/tokens) before issuing another"
        )
    token = new_token()
    repository.add_token(session, user_id=user.id, token_hash=hash_token(token))
    return IssuedToken(name=user.name, admin=user.is_admin, can_run_code=user.can_run_code, token=token)


def _target(session: Session, *, actor: User | None, name: str) -> User:
    # An admin (or the server-side CLI, actor None) may act on anyone; a user only on themselves.
    # Another's name answers 404 like an unknown one, so names do not leak. Names match whatever
    # their case, as the lookup does (the API's names are ASCII: Python's and SQL's lower() agree).
    if actor is not None and not actor.is_admin and actor.name.lower() != name.lower():
        raise NotFound(f"user {name!r} not found")
    user = repository.by_name(session, name=name)
    if user is None:
        raise NotFound(f"user {name!r} not found")
    return user


def issue_token(session: Session, *, actor: User | None, name: str, max_tokens: int) -> IssuedToken:
    """Another token for `name` (admins: anyone; users: themselves); Conflict past `max_tokens` live ones."""
    return _issue(session, user=_target(session, actor=actor, name=name), max_tokens=max_tokens)


def revoke_tokens(session: Session, *, actor: User | None, name: str) -> int:
    """Revoke every token of `name` at once (admins: anyone; users: themselves); returns how many."""
    user = _target(session, actor=actor, name=name)
    # API processes cache token -> user briefly: this one forgets the user once the revocation is in.
    forget_user_on_commit(session, user.id)
    return repository.revoke_tokens(session, user_id=user.id, now=utcnow())
