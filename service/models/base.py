"""Declarative base with a naming convention so Alembic constraint names stay stable."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Dialect, Integer, MetaData, TypeDecorator
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# JSONB on PostgreSQL, JSON text on SQLite.
JSONType = JSON().with_variant(JSONB(), "postgresql")
# SQLite only autoincrements an INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class UtcDateTime(TypeDecorator[datetime]):
    """`DateTime(timezone=True)` that always reads back timezone-aware UTC.

    PostgreSQL returns aware datetimes; SQLite (the embedded service) has no time zones and returns
    naive ones, which cannot be compared with `utcnow()`. Everything we store is UTC, so say so.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Attach UTC to a naive value read back from SQLite."""
        return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def utcnow() -> datetime:
    """Timezone-aware now, in UTC."""
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        dict[str, Any]: JSONType,
        list[dict[str, Any]]: JSONType,
        datetime: UtcDateTime(),
    }
