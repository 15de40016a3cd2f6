"""cluster: node addresses, per-node placements of running jobs, the reason a job waits

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 14:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("address", sa.String(length=255), nullable=False, server_default=""))
    op.create_table(
        "job_nodes",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=255), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=False),
        sa.Column("port", sa.Integer(), nullable=True),
        sa.Column("placed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "node_rank"),
        # One running job per rendezvous port: NULLs (single-node jobs) never collide.
        sa.UniqueConstraint("port", name="uq_job_nodes_port"),
    )
    op.create_index("ix_job_nodes_worker", "job_nodes", ["worker"], unique=False)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("queued_reason", sa.Text(), nullable=True))
        # Placement enforces the running-jobs limit now; nothing is deferred any more.
        batch_op.drop_column("quota_deferred")
        # Placement reads queued jobs highest priority first, then oldest.
        batch_op.create_index("ix_jobs_placement", ["status", "priority", "created_at", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_placement")
        batch_op.add_column(
            sa.Column("quota_deferred", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.drop_column("queued_reason")
    op.drop_index("ix_job_nodes_worker", table_name="job_nodes")
    op.drop_table("job_nodes")
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("address")
