"""security: idempotency keys of submits, the per-user running-jobs limit

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 12:05:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("idempotency_key", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("request_hash", sa.String(length=64), nullable=True))
        # server_default only fills the rows already there; the model sets the value on insert.
        batch_op.add_column(
            sa.Column("quota_deferred", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        # A unique constraint, not a read-then-write: of two concurrent submits with one key, one
        # insert wins and the other sees the winner. NULL keys never collide.
        batch_op.create_unique_constraint("uq_jobs_owner_idempotency_key", ["owner_id", "idempotency_key"])
        batch_op.create_index("ix_jobs_owner_status", ["owner_id", "status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_owner_status")
        batch_op.drop_constraint("uq_jobs_owner_idempotency_key", type_="unique")
        batch_op.drop_column("quota_deferred")
        batch_op.drop_column("request_hash")
        batch_op.drop_column("idempotency_key")
