"""Migration 0022: a trial's stored state is dropped (its job's status is its status), and back again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from migrations import alembic_config, upgrade
from service.models import Job, User

METRIC = "eval/loss"


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database at 0020: PostgreSQL's module database taken back, or a fresh SQLite file."""
    if request.param == "postgresql":
        db: str = request.getfixturevalue("own_database")
        command.downgrade(alembic_config(db), "0021")
        yield db
        upgrade(db)
        return
    db = f"sqlite:///{tmp_path / 'sweeps.db'}"
    upgrade(db, "0021")
    yield db


def add_job(conn: sa.Connection, *, job_id: str, status: str) -> None:
    """A job row of the first user: the columns the database has, each unset one with the model's default."""
    owner = conn.execute(sa.select(User.id)).scalar_one()
    values: dict[str, object] = {
        "id": job_id,
        "name": job_id,
        "owner_id": owner,
        "status": status,
        "spec": {"name": job_id},
        "labels": {},
        "latest_metrics": {},
        "total_steps": 2,
    }
    present = {c["name"] for c in sa.inspect(conn).get_columns("jobs")}
    for column in Job.__table__.columns:
        default = column.default
        if column.name in present and column.name not in values and isinstance(default, sa.ColumnDefault):
            values[column.name] = default.arg(None) if default.is_callable else default.arg  # type: ignore[operator]
    model = Job.__table__.c
    conn.execute(sa.insert(sa.table("jobs", *(sa.column(n, model[n].type) for n in values))).values(values))


def test_the_trial_state_goes_and_a_lost_objective_comes_back(url: str) -> None:
    engine = sa.create_engine(url)
    trials = sa.table(
        "sweep_trials",
        *(sa.column(n) for n in ("sweep_id", "number", "job_id", "state", "objective", "created_at")),
        sa.column("params", sa.JSON()),
    )
    with engine.begin() as conn:
        conn.execute(sa.insert(User.__table__).values(name="migrant"))  # type: ignore[arg-type]
        owner = conn.execute(sa.select(User.id)).scalar_one()
        spec = {"objective": {"metric": METRIC, "direction": "minimize"}}
        conn.execute(
            sa.insert(
                sa.table(
                    "sweeps",
                    *(sa.column(n) for n in ("id", "name", "owner_id", "state", "created_at")),
                    sa.column("spec", sa.JSON()),
                )
            ).values(id="sw", name="sw", owner_id=owner, state="running", spec=spec, created_at=sa.func.now())
        )
        rows = [
            ("done", "succeeded", "complete", 0.5),
            ("raced", "succeeded", "pruned", None),
            ("live", "running", "active", None),
        ]
        for number, (job_id, status, state, objective) in enumerate(rows):
            add_job(conn, job_id=job_id, status=status)
            conn.execute(
                sa.insert(trials).values(
                    sweep_id="sw",
                    number=number,
                    job_id=job_id,
                    params={},
                    state=state,
                    objective=objective,
                    created_at=sa.func.now(),
                )
            )
        metrics = sa.table("metrics", *(sa.column(n) for n in ("job_id", "attempt", "name", "step", "value")))
        for step, value in ((1, 2.0), (2, 0.25)):
            conn.execute(
                sa.insert(metrics).values(job_id="raced", attempt=1, name=METRIC, step=step, value=value)
            )
    upgrade(url)
    with engine.begin() as conn:
        assert "state" not in {c["name"] for c in sa.inspect(conn).get_columns("sweep_trials")}
        objectives = dict(conn.execute(sa.select(trials.c.job_id, trials.c.objective)).all())
    # The trial the old driver marked pruned while its job succeeded gets its result back.
    assert objectives == {"done": 0.5, "raced": 0.25, "live": None}, objectives
    command.downgrade(alembic_config(url), "0021")
    with engine.begin() as conn:
        states = dict(conn.execute(sa.select(trials.c.job_id, trials.c.state)).all())
    engine.dispose()
    assert states == {"done": "complete", "raced": "complete", "live": "active"}, states
