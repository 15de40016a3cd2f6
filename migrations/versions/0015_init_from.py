"""init_from: the checkpoint a job starts from, pinned (a hard link) and its sha256 recorded

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26 11:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        # No foreign key on the source job: the new job must outlive its source's deletion.
        batch_op.add_column(sa.Column("init_job", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("init_step", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("init_path", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("init_sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        for column in ("init_sha256", "init_path", "init_step", "init_job"):
            batch_op.drop_column(column)
