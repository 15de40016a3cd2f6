"""polling at scale: the workers table and the indexes of updated_since, labels, events and /metrics

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 11:13:52.401717
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("device", sa.String(length=8), nullable=False),
        sa.Column("device_count", sa.Integer(), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_workers")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        # (status, created_at, id) serves everything the status-only index did, and sorted pages too.
        batch_op.drop_index("ix_jobs_status")
        batch_op.create_index("ix_jobs_status_created", ["status", "created_at", "id"], unique=False)
        batch_op.create_index("ix_jobs_started_at", ["started_at"], unique=False)
        batch_op.create_index("ix_jobs_updated_at", ["updated_at"], unique=False)
    if op.get_bind().dialect.name == "postgresql":
        # `labels @> '{"k": "v"}'`; SQLite has no GIN and filters labels with json_extract instead.
        op.create_index(
            "ix_jobs_labels",
            "jobs",
            ["labels"],
            unique=False,
            postgresql_using="gin",
            postgresql_ops={"labels": "jsonb_path_ops"},
        )
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        # With `id` last, a series comes in (step, id) order for dedup and downsampling, no sort.
        batch_op.drop_index("ix_metrics_job_name_step")
        batch_op.create_index("ix_metrics_job_name_step_id", ["job_id", "name", "step", "id"], unique=False)
        batch_op.create_index("ix_metrics_job_id_id", ["job_id", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.drop_index("ix_metrics_job_id_id")
        batch_op.drop_index("ix_metrics_job_name_step_id")
        batch_op.create_index("ix_metrics_job_name_step", ["job_id", "name", "step"], unique=False)
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_jobs_labels", table_name="jobs")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_updated_at")
        batch_op.drop_index("ix_jobs_started_at")
        batch_op.drop_index("ix_jobs_status_created")
        batch_op.create_index("ix_jobs_status", ["status"], unique=False)
    op.drop_table("workers")
