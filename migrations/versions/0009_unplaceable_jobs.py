"""unplaceable jobs: jobs.unplaceable, set while no set of live nodes could ever hold a queued job

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        # Jobs queued before this column existed are judged again by the next placement round.
        batch_op.add_column(sa.Column("unplaceable", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("unplaceable")
