"""drop ix_jobs_placement: placement reads each owner's heads through ix_jobs_queue_owner now

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 15:00:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Its one reader, the global scan of the first queued jobs by priority, went with fair queues
    # (0010); every job write still paid to keep it. Queries by status use ix_jobs_status_created.
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index("ix_jobs_placement")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.create_index("ix_jobs_placement", ["status", "priority", "created_at", "id"], unique=False)
