"""JSON columns on both databases: never written with NaN or infinity, always read back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, update
from sqlalchemy.exc import StatementError

from service.db import load_json, make_engine
from service.models import Job, MetricRollup
from tests.api_fixtures import SPEC
from tests.backends import BACKENDS, sessions_of, sqlite_app, sqlite_app_settings, store_raw


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
