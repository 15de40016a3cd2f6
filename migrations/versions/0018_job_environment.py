"""job environments: how the current attempt had its Python environment, and each node's cached ones

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-26 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("environment_state", JSON, nullable=True))
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("environments", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("environments")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("environment_state")
