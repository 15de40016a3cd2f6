"""metric rollups: per-block summaries of metric series for the downsampled query

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 15:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # No backfill: a block without a row is read from the level below or the raw points, so series
    # written before this revision answer as before (just not faster) and new points get rows.
    op.create_table(
        "metric_rollups",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("level", sa.SmallInteger(), nullable=False),
        sa.Column("block", sa.BigInteger(), nullable=False),
        sa.Column("points", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("min_step", sa.BigInteger(), nullable=False),
        sa.Column("min_value", sa.Float(), nullable=False),
        sa.Column("max_step", sa.BigInteger(), nullable=False),
        sa.Column("max_value", sa.Float(), nullable=False),
        sa.Column("max_id", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_metric_rollups_job_id_jobs"), ondelete="CASCADE"
        ),
        # (job, name, level, block) first: the query reads ranges of blocks of one level of a series.
        sa.PrimaryKeyConstraint("job_id", "name", "level", "block", name=op.f("pk_metric_rollups")),
    )


def downgrade() -> None:
    op.drop_table("metric_rollups")
