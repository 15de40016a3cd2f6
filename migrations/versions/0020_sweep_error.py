"""sweep error: why a sweep ended failed when no trial of it did (e.g. its owner lost a grant)

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-26 13:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("error", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.drop_column("error")
