"""job node rank uid: the uid a multi-node attempt's ranks run as on every node, given by placement

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-28 13:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job_nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rank_uid", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_nodes", schema=None) as batch_op:
        batch_op.drop_column("rank_uid")
