"""Users and their API tokens (stored as sha256 hashes, never in clear)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, String, func
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, utcnow


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(default=False)
    # May upload code and submit jobs that run it (an entrypoint, a command); admins always may.
    can_run_code: Mapped[bool] = mapped_column(default=False)
    # The highest job `priority` they may submit (an admin grants more); admins are not bound by it.
    max_priority: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


# `Alice` and `alice` are one user: names are unique whatever their case (migration 0011), and
# looked up by lower(name), which this index also serves.
Index("uq_users_name_lower", func.lower(User.name), unique=True)


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
