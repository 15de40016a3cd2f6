"""sweeps: hyperparameter sweeps and their trials

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-26 11:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("prune_requested", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("spec", JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["owner_id"], ["users.id"], name=op.f("fk_sweeps_owner_id_users"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweeps")),
    )
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.create_index("ix_sweeps_owner_created", ["owner_id", "created_at"], unique=False)
        batch_op.create_index("ix_sweeps_state", ["state"], unique=False)
    op.create_table(
        "sweep_trials",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("sweep_id", sa.String(length=32), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("params", JSON, nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("objective", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["sweep_id"], ["sweeps.id"], name=op.f("fk_sweep_trials_sweep_id_sweeps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweep_trials")),
        sa.UniqueConstraint("sweep_id", "number", name="uq_sweep_trials_sweep_number"),
    )


def downgrade() -> None:
    op.drop_table("sweep_trials")
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.drop_index("ix_sweeps_state")
        batch_op.drop_index("ix_sweeps_owner_created")
    op.drop_table("sweeps")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("prune_requested")
