"""fair queues: users.max_priority, jobs.device and jobs.fair_key, and the queued-jobs indexes

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

QUEUED = sa.text("status = 'queued'")
PLACEABLE = sa.text("status = 'queued' AND NOT unplaceable")


def upgrade() -> None:
    with op.batch_alter_table("users", schema=None) as batch_op:
        # The highest `priority` the user may submit; admins are not bound by it.
        batch_op.add_column(sa.Column("max_priority", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("device", sa.String(length=8), nullable=False, server_default="cpu"))
        # Jobs queued before this column existed keep their old order (priority, then oldest).
        batch_op.add_column(sa.Column("fair_key", sa.BigInteger(), nullable=False, server_default="0"))
    if op.get_bind().dialect.name == "postgresql":
        # `->` of a key on a JSONB scalar or array is NULL, never an error.
        op.execute("UPDATE jobs SET device = 'cuda' WHERE spec -> 'resources' ->> 'device' = 'cuda'")
    else:
        # SQLite's json_extract fails the statement on one malformed text: json_valid first.
        op.execute(
            "UPDATE jobs SET device = 'cuda' WHERE CASE WHEN json_valid(spec) "
            "THEN json_extract(spec, '$.resources.device') = 'cuda' ELSE 0 END"
        )
    # Queue positions count the placeable queued jobs of a device kind ahead of a job; placement
    # reads each owner's first queued jobs per device kind; a submit finds its fair key.
    op.create_index(
        "ix_jobs_queue",
        "jobs",
        ["device", "priority", "fair_key", "created_at", "id"],
        postgresql_where=PLACEABLE,
        sqlite_where=PLACEABLE,
    )
    op.create_index(
        "ix_jobs_queue_owner",
        "jobs",
        ["owner_id", "device", "priority", "fair_key"],
        postgresql_where=QUEUED,
        sqlite_where=QUEUED,
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_queue_owner", table_name="jobs")
    op.drop_index("ix_jobs_queue", table_name="jobs")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("fair_key")
        batch_op.drop_column("device")
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.drop_column("max_priority")
