"""Bearer tokens: generated at random, stored only as sha256 hashes."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import ApiToken, User


def hash_token(token: str) -> str:
    """The stored form of a token. Tokens are 256-bit random, so a plain sha256 is enough (no salt needed)."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token."""
    return "dpt_" + secrets.token_urlsafe(32)


def user_for_token(session: Session, *, token: str) -> User | None:
    """The user a valid, unrevoked token belongs to."""
    stmt = (
        select(User)
        .join(ApiToken, ApiToken.user_id == User.id)
        .where(ApiToken.token_hash == hash_token(token), ApiToken.revoked_at.is_(None))
    )
    return session.execute(stmt).scalar_one_or_none()


def ensure_bootstrap_admin(session: Session, *, token: str, name: str = "admin") -> User:
    """Make sure an admin named `name` exists and `token` is one of its tokens (idempotent)."""
    user = session.execute(select(User).where(User.name == name)).scalar_one_or_none()
    if user is None:
        user = User(name=name, is_admin=True)
        session.add(user)
        session.flush()
    digest = hash_token(token)
    exists = session.execute(select(ApiToken.id).where(ApiToken.token_hash == digest)).first()
    if exists is None:
        session.add(ApiToken(user_id=user.id, token_hash=digest))
        session.flush()
    return user
