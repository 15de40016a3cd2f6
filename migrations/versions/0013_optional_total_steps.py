"""jobs.total_steps nullable: a command job without hyperparameters.steps has no total

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 09:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# SQLite rebuilds the table from its reflection; the tables its keys point at need no reflecting
# (users' expression index would only be skipped with a warning).
_REFLECT = {"resolve_fks": False}


def upgrade() -> None:
    # A command's progress counts against hyperparameters.steps only when the user sent it; the
    # recipe default (100) stood in before, and a job showed "step 0/100" for a total it never had.
    with op.batch_alter_table("jobs", reflect_kwargs=_REFLECT) as batch_op:
        batch_op.alter_column("total_steps", existing_type=sa.Integer(), nullable=True)


def downgrade() -> None:
    # The old schema needs a number: a job without a total shows the last step it reached as its total.
    op.execute("UPDATE jobs SET total_steps = step WHERE total_steps IS NULL")
    with op.batch_alter_table("jobs", reflect_kwargs=_REFLECT) as batch_op:
        batch_op.alter_column("total_steps", existing_type=sa.Integer(), nullable=False)
