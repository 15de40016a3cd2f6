"""rank stacks: py-spy dumps of a job's ranks, and the requests for one

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stack_requests",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_stack_requests_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_stack_requests")),
    )
    op.create_table(
        "rank_stacks",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("dump", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_rank_stacks_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rank_stacks")),
    )
    with op.batch_alter_table("rank_stacks", schema=None) as batch_op:
        batch_op.create_index("ix_rank_stacks_job_id_id", ["job_id", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("rank_stacks", schema=None) as batch_op:
        batch_op.drop_index("ix_rank_stacks_job_id_id")
    op.drop_table("rank_stacks")
    op.drop_table("stack_requests")
