"""best checkpoints: checkpoints.best, the one checkpoint.keep_best keeps as the job's best

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        # Checkpoints written before keep_best existed were never anybody's best.
        batch_op.add_column(sa.Column("best", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_column("best")
