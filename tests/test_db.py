"""The schema the migrations build on both databases; JSON columns never written with NaN or infinity."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Engine, create_engine, inspect, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import StatementError

from migrations import alembic_config, upgrade
from service.db import load_json, make_engine
from service.models import Job, MetricRollup
from tests.api_fixtures import SPEC
from tests.backends import BACKENDS, sessions_of, sqlite_app, sqlite_app_settings, store_raw
from tests.conftest import PG_ADMIN_URL, drop_database
from tests.databases import clone_pg_template, migrated_sqlite


@pytest.fixture(params=BACKENDS)
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of the backend: no table, no revision."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    name = f"dptrain_replay_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    yield url
    drop_database(url)


def _schema(url: str) -> dict[str, object]:
    """Every table's columns, indexes and constraints, as the database reports them, and the revision."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            found = inspect(conn)
            tables: dict[str, object] = {
                table: (
                    [(c["name"], str(c["type"]), c["nullable"]) for c in found.get_columns(table)],
                    sorted((i["name"] or "", tuple(i["column_names"])) for i in found.get_indexes(table)),
                    sorted(str(u["name"]) for u in found.get_unique_constraints(table)),
                    sorted(str(f["name"]) for f in found.get_foreign_keys(table)),
                )
                for table in found.get_table_names()
            }
            tables["alembic_version"] = conn.execute(text("SELECT version_num FROM alembic_version")).all()
            return tables
    finally:
        engine.dispose()


# SQLite's reflection cannot read the expression index on lower(name): both sides skip it alike.
@pytest.mark.filterwarnings("ignore:Skipped unsupported reflection of expression-based index")
def test_the_migrations_replayed_on_an_empty_database_give_what_the_tests_clone(
    empty_url: str, tmp_path: Path
) -> None:
    # Every other test gets a copy of a template (tests/databases.py): this one replays them all.
    upgrade(empty_url)
    if empty_url.startswith("sqlite"):
        cloned = migrated_sqlite(tmp_path / "clone.db")
    else:
        # The models and the migrations agree (PostgreSQL only: its GIN index has no SQLite form).
        command.check(alembic_config(empty_url))
        cloned = clone_pg_template(PG_ADMIN_URL, f"dptrain_clone_{uuid.uuid4().hex[:10]}")
    try:
        assert _schema(cloned) == _schema(empty_url), "the template is the migrations' schema at head"
    finally:
        if not cloned.startswith("sqlite"):
            drop_database(cloned)


@pytest.fixture(params=BACKENDS)
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """The engine `dptrain` itself makes for the backend."""
    if request.param == "postgresql":
        url = request.getfixturevalue("pg_url")
    else:
        url = sqlite_app_settings(tmp_path).database_url
    made = make_engine(url)
    yield made
    made.dispose()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("column", ["spec", "labels", "error", "latest_metrics"])
def test_a_non_finite_number_is_never_written_to_a_json_column(
    engine: Engine, column: str, value: float
) -> None:
    with engine.connect() as conn, conn.begin():
        # SQLite binds through SQLAlchemy (a StatementError around it), psycopg dumps JSONB itself.
        with pytest.raises((StatementError, ValueError)) as caught:
            conn.execute(update(Job).where(Job.id == "none").values({column: {"deep": [1.0, {"x": value}]}}))
        cause = caught.value.orig if isinstance(caught.value, StatementError) else caught.value
        assert "not JSON compliant" in str(cause), f"refused by the serializer: {caught.value!r}"
        # Finite numbers, and floats in plain Float columns, are as before.
        conn.execute(update(Job).where(Job.id == "none").values({column: {"x": 1e308}}))
        conn.execute(update(MetricRollup).where(MetricRollup.job_id == "none").values(min_value=value))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": [1, 2.5, null]}', {"a": [1, 2.5, None]}),
        (b'{"lr": 1e999}', {"lr": float("inf")}),  # JSONB holds it; reading it is the reader's problem
        ('{"name": "x", "reso', '{"name": "x", "reso'),
        (b'{"cut": [', '{"cut": ['),
        ("[" * 100_000, "[" * 100_000),
    ],
)
def test_load_json_never_raises(text: str | bytes, expected: object) -> None:
    assert load_json(text) == expected


def test_a_row_whose_json_text_does_not_parse_still_loads(tmp_path: Path) -> None:
    # Only SQLite can hold such text (a JSONB column refuses it): the embedded service.
    with sqlite_app(tmp_path) as client:
        job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
        cut = json.dumps(SPEC)[:30]
        store_raw(client, job_id=job_id, column="spec", raw=cut)
        with sessions_of(client)() as s:
            job = s.get(Job, job_id)
            assert job is not None and job.spec == cut, "the text as it is, for whoever validates it"
