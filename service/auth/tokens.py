"""Bearer tokens: generated at random, stored only as sha256 hashes."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy.orm import Session

from service.models import User
from service.users import repository


def hash_token(token: str) -> str:
    """The stored form of a token. Tokens are 256-bit random, so a plain sha256 is enough (no salt needed)."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token."""
    return "dpt_" + secrets.token_urlsafe(32)


def ensure_bootstrap_admin(session: Session, *, token: str, name: str = "admin") -> User:
    """Make sure an admin named `name` exists and `token` is one of its tokens (idempotent).

    A bootstrap token that was revoked stays revoked: its hash is already stored, so it is not
    added again at the next start.
    """
    user = repository.by_name(session, name=name) or repository.create(session, name=name, is_admin=True)
    if user is None:  # created by a concurrent start in between
        user = repository.by_name(session, name=name)
    assert user is not None
    repository.add_token(session, user_id=user.id, token_hash=hash_token(token))
    return user
