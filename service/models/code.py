"""Uploaded code archives (content-addressed by sha256) and who uploaded each."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, utcnow


class CodeArchive(Base):
    """One stored `.tar.gz`; its file is `rank_contract.layout.code_archive(artifacts, sha256)`."""

    __tablename__ = "code_archives"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Bumped by every upload and every submit that refers to it: retention goes by it.
    last_used_at: Mapped[datetime] = mapped_column(default=utcnow)


class CodeUpload(Base):
    """A user uploaded an archive: they may download it again."""

    __tablename__ = "code_uploads"

    sha256: Mapped[str] = mapped_column(
        ForeignKey("code_archives.sha256", ondelete="CASCADE"), primary_key=True
    )
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
