"""`dptrain status` and `watch` show a job preparing its environment, with the time it has taken."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from api_schemas import EnvironmentBuild, Job, JobStatus
from dptrain_cli.follow import environment_text
from tests.api_fixtures import SPEC


def _job(status: JobStatus, build: EnvironmentBuild | None) -> Job:
    now = datetime.now(UTC)
    fields: dict[str, Any] = dict(
        id="j1",
        name="x",
        status=status,
        spec=SPEC,
        owner="admin",
        created_at=now,
        updated_at=now,
        started_at=now,
        finished_at=None,
        progress={"step": 0, "total_steps": 10},
        attempt=1,
        error=None,
        environment_build=build,
    )
    return Job.model_validate(fields)


def test_a_running_job_shows_preparing_environment_with_the_elapsed_time() -> None:
    started = datetime(2026, 1, 1, tzinfo=UTC)
    build = EnvironmentBuild(state="preparing", started_at=started)
    text = environment_text(_job(JobStatus.RUNNING, build), now=started + timedelta(seconds=12))
    assert text == "preparing environment (12 s)"
    assert environment_text(_job(JobStatus.FAILED, build)) is None, "an ended job prepares nothing"


def test_a_ready_environment_says_how_it_was_had() -> None:
    hit = EnvironmentBuild(state="ready", key="ab" * 32, cache_hit=True, build_seconds=0.01)
    assert environment_text(_job(JobStatus.RUNNING, hit)) == f"environment {'ab' * 8}: cache hit"
    built = hit.model_copy(update={"cache_hit": False, "build_seconds": 3.25})
    assert environment_text(_job(JobStatus.SUCCEEDED, built)) == f"environment {'ab' * 8}: built in 3.2 s"
    assert environment_text(_job(JobStatus.RUNNING, None)) is None
