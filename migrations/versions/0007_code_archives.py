"""code archives: uploaded code trees and their uploaders, users.can_run_code

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "code_archives",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_code_archives")),
    )
    op.create_table(
        "code_uploads",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["sha256"],
            ["code_archives.sha256"],
            name=op.f("fk_code_uploads_sha256_code_archives"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_code_uploads_user_id_users"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("sha256", "user_id", name=op.f("pk_code_uploads")),
    )
    with op.batch_alter_table("users", schema=None) as batch_op:
        # Nobody runs user code until an admin grants it (admins always may).
        batch_op.add_column(
            sa.Column("can_run_code", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.drop_column("can_run_code")
    op.drop_table("code_uploads")
    op.drop_table("code_archives")
