"""case-insensitive user names: a unique index on lower(users.name)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Names that differ only in case would make the index fail with a bare integrity error; say
    # which they are instead. Which of two accounts to keep is the operator's call, not ours: each
    # has its own jobs and tokens. Grouped by the database's lower(), the one the index uses.
    rows = op.get_bind().execute(sa.text("SELECT lower(name), name FROM users ORDER BY name")).all()
    groups: dict[str, list[str]] = {}
    for folded, name in rows:
        groups.setdefault(folded, []).append(name)
    clashes = [names for names in groups.values() if len(names) > 1]
    if clashes:
        listed = "; ".join(", ".join(repr(n) for n in names) for names in clashes)
        raise RuntimeError(
            "user names must be unique whatever their case, and these differ only in case: "
            f"{listed}. Rename all but one of each (UPDATE users SET name = ... WHERE name = ...), "
            "then run the migration again."
        )
    op.create_index("uq_users_name_lower", "users", [sa.text("lower(name)")], unique=True)


def downgrade() -> None:
    op.drop_index("uq_users_name_lower", table_name="users")
