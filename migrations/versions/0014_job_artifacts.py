"""job artifacts: the files a job's DPTRAIN_OUTPUT_DIR held at the end of its last attempt

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_artifacts",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_artifacts_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_artifacts")),
    )
    with op.batch_alter_table("job_artifacts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_job_artifacts_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("job_artifacts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_job_artifacts_job_id"))
    op.drop_table("job_artifacts")
