"""Schemathesis against /openapi.json with a valid token: no 5xx, responses as documented, auth enforced.

Bounded: a few generated requests per operation, in-process over ASGI, against a database of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from api_schemas import JobSpec, JobStatus
from service.app import create_app
from service.auth.tokens import ensure_bootstrap_admin
from service.config import Settings
from service.db import session_factory
from service.jobs import lifecycle, submit
from service.models import Checkpoint
from tests.api_fixtures import ADMIN_TOKEN, SPEC, RecordingScheduler
from workers.engine.checkpoint import checkpoint_name

# Per operation and phase; about 15 operations, so a few hundred requests in all.
MAX_EXAMPLES = 25


def _settings(database_url: str, root: Path) -> Settings:
    return Settings(
        database_url=database_url,
        broker_url="memory://",
        artifact_root=root,
        # Hundreds of requests with one token, and a wrong one for every operation from one address:
        # the rate limits have tests of their own (test_limits.py, test_invalid_tokens.py).
        rate_limit_per_second=0,
        auth_failures_per_second=0,
    )


# Built at import so that schemathesis can parametrize the test by operation (its lazy, fixture-
# based loader does not run under this pytest). Nothing connects to a database until the fixture
# below has made one and pointed the app at it (no bootstrap token here: the lifespan, which
# schemathesis runs, has nothing to do; the fixture adds the admin).
app = create_app(
    _settings("postgresql+psycopg://unused@127.0.0.1/unused", Path("/nonexistent")),
    scheduler=RecordingScheduler(),
)
# Every operation, the event stream and the checkpoint download included: a generated job id names
# no job, so they answer 404 (or 422, 401) like the others; their 200s, a stream and a file, are
# validated on a finished job of the fixture's below.
# A code archive is raw bytes: generated as such (and refused as not gzip or not matching its hash).
schemathesis.serializer.alias("application/gzip", "application/octet-stream")
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@schema.auth()
class Bearer:
    """The bootstrap admin's token on every generated request; the auth checks take it away."""

    def get(self, case: Any, ctx: Any) -> str:
        return ADMIN_TOKEN

    def set(self, case: Any, data: str, ctx: Any) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


@pytest.fixture(scope="module", autouse=True)
def database(own_database: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The admin, and a succeeded job of theirs with a checkpoint file: its path parameters."""
    app.state.settings = _settings(own_database, tmp_path_factory.mktemp("fuzz") / "artifacts")
    app.state.session_factory = session_factory(app.state.settings)
    with app.state.session_factory.begin() as session:
        admin = ensure_bootstrap_admin(session, token=ADMIN_TOKEN)
        job_id = submit.submit(
            session, user=admin, spec=JobSpec.model_validate(SPEC), settings=app.state.settings
        )[0].id
        lifecycle.transition(session, job_id=job_id, src=JobStatus.QUEUED, dst=JobStatus.RUNNING)
        lifecycle.transition(session, job_id=job_id, src=JobStatus.RUNNING, dst=JobStatus.SUCCEEDED)
        path = app.state.settings.artifacts / "jobs" / job_id / "checkpoints" / checkpoint_name(1)
        path.parent.mkdir(parents=True)
        path.write_bytes(b"weights")
        checkpoint = Checkpoint(
            job_id=job_id, attempt=1, step=1, path=str(path), size_bytes=7, sha256="c" * 64
        )
        session.add(checkpoint)
        session.flush()
        return {"job_id": job_id, "checkpoint_id": str(checkpoint.id)}


@schema.parametrize()
# derandomize: the same requests every run, so CI does not flake; raise MAX_EXAMPLES (or drop
# derandomize) locally to explore further.
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case: Any) -> None:
    # Every default check (no 5xx, status codes, content types, headers and bodies as documented,
    # invalid input refused, auth enforced: ignored_auth sends each request again without the
    # token and with a wrong one) but positive_data_acceptance: the schema cannot express the
    # cross-field rules (a known recipe, a global batch divisible by the world size, `tail`
    # without `after`, an entrypoint under the allowed prefixes), so a schema-valid request may
    # rightly get 422.
    case.call_and_validate(excluded_checks=[positive_data_acceptance])


@pytest.mark.parametrize(
    "path", ["/v1/jobs/{job_id}/events", "/v1/jobs/{job_id}/checkpoints/{checkpoint_id}/download"]
)
def test_a_finished_job_s_stream_and_checkpoint_file_are_as_documented(
    database: dict[str, str], path: str
) -> None:
    # Generated ids never name a job, so the 200s of these two are checked here: a finished job's
    # stream ends (its last event is `end`), and the file comes with its documented type and header.
    operation = schema[path]["GET"]
    params = {k: v for k, v in database.items() if "{" + k + "}" in path}
    case = operation.Case(path_parameters=params, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    response = case.call_and_validate(excluded_checks=[positive_data_acceptance])
    assert response.status_code == 200, response.text
