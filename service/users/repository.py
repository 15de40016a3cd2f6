"""Every SQL query of the users domain: users and their hashed tokens."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.db import insert_for, is_postgresql
from service.models import ApiToken, User


def by_name(session: Session, *, name: str) -> User | None:
    """A user by name, whatever its case (names are unique by lower(name))."""
    stmt = select(User).where(func.lower(User.name) == func.lower(name))
    return session.execute(stmt).scalar_one_or_none()


def create(session: Session, *, name: str, is_admin: bool, can_run_code: bool = False) -> User | None:
    """Insert a user; None if the name is taken in any case (the unique indexes decide, even under a race)."""
    stmt = (
        insert_for(session, User)
        .values(name=name, is_admin=is_admin, can_run_code=can_run_code)
        # No conflict target: the name's exact and lower-case indexes both refuse a taken name.
        .on_conflict_do_nothing()
        .returning(User.id)
    )
    user_id = session.execute(stmt).scalar_one_or_none()
    return None if user_id is None else session.get(User, user_id)


def set_can_run_code(session: Session, *, user_id: int, allowed: bool) -> None:
    """Grant or withdraw running user code."""
    session.execute(update(User).where(User.id == user_id).values(can_run_code=allowed))


def set_max_priority(session: Session, *, user_id: int, ceiling: int) -> None:
    """Set the highest job priority a user may submit."""
    session.execute(update(User).where(User.id == user_id).values(max_priority=ceiling))


def add_token(session: Session, *, user_id: int, token_hash: str) -> None:
    """Store one more token hash of a user (a hash already stored is left as it is)."""
    stmt = (
        insert_for(session, ApiToken)
        .values(user_id=user_id, token_hash=token_hash)
        .on_conflict_do_nothing(index_elements=[ApiToken.token_hash])
    )
    session.execute(stmt)


def lock_user(session: Session, *, user_id: int) -> None:
    """Lock the user's row until this transaction ends: what counts against one of the user's caps
    (queued jobs, live tokens) is counted by one transaction at a time."""
    # FOR NO KEY UPDATE, not FOR UPDATE: a job just inserted holds FOR KEY SHARE on this row (its
    # foreign key), which FOR UPDATE would wait on in every other submit of the user: a deadlock.
    # SQLite has no row locks, and needs none: a write already took its one database write lock.
    if is_postgresql(session):
        session.execute(select(User.id).where(User.id == user_id).with_for_update(key_share=True))


def live_token_count(session: Session, *, user_id: int) -> int:
    """How many unrevoked tokens a user holds, with the user's row locked until the commit.

    Locked so that two concurrent mints cannot both pass a cap.
    """
    lock_user(session, user_id=user_id)
    stmt = select(func.count()).where(ApiToken.user_id == user_id, ApiToken.revoked_at.is_(None))
    return int(session.execute(stmt).scalar_one())


def revoke_tokens(session: Session, *, user_id: int, now: datetime) -> int:
    """Revoke every live token of a user; returns how many."""
    stmt = (
        update(ApiToken)
        .where(ApiToken.user_id == user_id, ApiToken.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    return int(session.execute(stmt).rowcount or 0)  # type: ignore[attr-defined]


def user_for_token_hash(session: Session, *, token_hash: str) -> User | None:
    """The user of a live (unrevoked) token hash."""
    stmt = (
        select(User)
        .join(ApiToken, ApiToken.user_id == User.id)
        .where(ApiToken.token_hash == token_hash, ApiToken.revoked_at.is_(None))
    )
    return session.execute(stmt).scalar_one_or_none()
