"""Migration 0013: jobs.total_steps takes NULL (a command without a total), and back again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from migrations import alembic_config, upgrade
from service.models import Job, User


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database at 0012: PostgreSQL's module database taken back, or a fresh SQLite file."""
    if request.param == "postgresql":
        db: str = request.getfixturevalue("own_database")
        command.downgrade(alembic_config(db), "0012")
        yield db
        upgrade(db)
        return
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    upgrade(db, "0012")
    yield db


def add_job(conn: sa.Connection, *, job_id: str, step: int, total: int | None) -> None:
    """A job row of the first user, with only what 0012 and 0013 agree on set.

    Only the columns the database has at its revision, each other one with the model's default:
    columns of later migrations do not exist here.
    """
    owner = conn.execute(sa.select(User.id)).scalar_one()
    values: dict[str, object] = {
        "id": job_id,
        "name": job_id,
        "owner_id": owner,
        "status": "running",
        "spec": {"name": job_id},
        "labels": {},
        "latest_metrics": {},
        "step": step,
        "total_steps": total,
    }
    present = {c["name"] for c in sa.inspect(conn).get_columns("jobs")}
    for column in Job.__table__.columns:
        default = column.default
        if column.name in present and column.name not in values and isinstance(default, sa.ColumnDefault):
            values[column.name] = default.arg(None) if default.is_callable else default.arg  # type: ignore[operator]
    model = Job.__table__.c
    table = sa.table("jobs", *(sa.column(name, model[name].type) for name in values))
    conn.execute(sa.insert(table).values(values))


def test_total_steps_becomes_optional_and_a_downgrade_gives_a_total_back(url: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.insert(User.__table__).values(name="migrant"))  # type: ignore[arg-type]
        add_job(conn, job_id="recipe", step=3, total=50)
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        add_job(conn, job_id="early", step=0, total=None)
    upgrade(url)
    with engine.begin() as conn:
        add_job(conn, job_id="script", step=7, total=None)
    command.downgrade(alembic_config(url), "0012")
    with engine.begin() as conn:
        totals = {job_id: total for job_id, total in conn.execute(sa.select(Job.id, Job.total_steps))}
    engine.dispose()
    assert totals == {"recipe": 50, "script": 7}, "without a total, the last step stands in for one"
