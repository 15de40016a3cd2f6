"""Migration 0011: user names unique whatever their case, refusing loudly where they are not yet."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from migrations import upgrade


def test_names_differing_only_in_case_stop_the_migration_naming_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'users.db'}"
    upgrade(url, "0009")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for name in ("Alice", "alice", "bob"):
            conn.execute(
                sa.text(
                    "INSERT INTO users (name, is_admin, can_run_code, created_at) "
                    "VALUES (:n, false, false, CURRENT_TIMESTAMP)"
                ),
                {"n": name},
            )
    with pytest.raises(RuntimeError) as refused:
        upgrade(url, "head")
    assert "'Alice', 'alice'" in str(refused.value) and "bob" not in str(refused.value), refused.value
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE users SET name = 'alice2' WHERE name = 'alice'"))
    upgrade(url, "head")
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO users (name, is_admin, can_run_code, created_at) "
                "VALUES ('BOB', false, false, CURRENT_TIMESTAMP)"
            )
        )
    engine.dispose()
