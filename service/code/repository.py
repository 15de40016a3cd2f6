"""Every SQL query of the code domain: archives, their uploaders, and the jobs that refer to them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, delete, exists, select, update
from sqlalchemy.orm import Session

from service.db import insert_for
from service.models import CodeArchive, CodeUpload, Job


def _code_of_job() -> ColumnElement[Any]:
    # `spec.code.sha256` as text: JSONB's `->`/`->>` on PostgreSQL, json_extract on SQLite; NULL
    # for a job without code.
    return Job.spec["code"]["sha256"].as_string()


def size_of(session: Session, *, sha256: str) -> int | None:
    """The size of a stored archive, None if there is no row for it."""
    stmt = select(CodeArchive.size_bytes).where(CodeArchive.sha256 == sha256)
    return session.execute(stmt).scalar_one_or_none()


def record(session: Session, *, sha256: str, size_bytes: int, user_id: int, now: datetime) -> bool:
    """Record an archive (or mark it used again) and its uploader; True if the archive row is new."""
    stmt = (
        insert_for(session, CodeArchive)
        .values(sha256=sha256, size_bytes=size_bytes, created_at=now, last_used_at=now)
        .on_conflict_do_nothing(index_elements=[CodeArchive.sha256])
        .returning(CodeArchive.sha256)
    )
    created = session.execute(stmt).scalar_one_or_none() is not None
    if not created:
        touch(session, sha256=sha256, now=now)
    session.execute(
        insert_for(session, CodeUpload)
        .values(sha256=sha256, user_id=user_id, created_at=now)
        .on_conflict_do_nothing(index_elements=[CodeUpload.sha256, CodeUpload.user_id])
    )
    return created


def touch(session: Session, *, sha256: str, now: datetime) -> bool:
    """Mark an archive used now; False if there is no such archive."""
    stmt = update(CodeArchive).where(CodeArchive.sha256 == sha256).values(last_used_at=now)
    return bool(session.execute(stmt).rowcount)  # type: ignore[attr-defined]


def is_uploader(session: Session, *, sha256: str, user_id: int) -> bool:
    """Whether the user uploaded the archive (or uploaded the same bytes again)."""
    stmt = select(exists().where(CodeUpload.sha256 == sha256, CodeUpload.user_id == user_id))
    return bool(session.execute(stmt).scalar())


def delete_unused(session: Session, *, used_before: datetime) -> list[str]:
    """Delete the rows of archives no job refers to and nobody used since `used_before`; their hashes.

    One statement, so that a submit that marks an archive used meanwhile (its row locked) either
    lands first, and the row is kept, or finds the row gone and is refused.
    """
    stmt = (
        delete(CodeArchive)
        .where(
            CodeArchive.last_used_at < used_before,
            ~exists().where(_code_of_job() == CodeArchive.sha256),
        )
        .returning(CodeArchive.sha256)
    )
    return list(session.execute(stmt).scalars())
