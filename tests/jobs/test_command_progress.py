"""A command job's progress and spec are what the user sent: no recipe defaults, no invented total."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api_schemas import Job, JobSpec
from service.jobs import service
from service.models import Job as JobRow
from service.models.base import utcnow
from tests.backends import BACKENDS, client_on, sessions_of

COMMAND: dict[str, Any] = {"name": "script", "command": ["python", "-m", "team.train"]}


@pytest.fixture(params=BACKENDS)
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    """An admin's client on PostgreSQL, then on SQLite (total_steps is nullable on both, by 0013)."""
    yield from client_on(request, tmp_path)


def submitted(api: TestClient, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job as POST answered it and as GET answers it."""
    r = api.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job = r.json()
    got = api.get(f"/v1/jobs/{job['id']}")
    assert got.status_code == 200, got.text
    return job, got.json()


def stored(api: TestClient, job_id: str) -> tuple[dict[str, Any], int | None]:
    """The row's spec and total_steps columns."""
    with sessions_of(api)() as s:
        spec, total = s.execute(select(JobRow.spec, JobRow.total_steps).where(JobRow.id == job_id)).one()
    return spec, total


def test_a_command_without_hyperparameters_shows_no_defaults_and_no_total(api: TestClient) -> None:
    posted, job = submitted(api, COMMAND)
    for seen in (posted, job):
        assert seen["spec"]["hyperparameters"] == {}, f"defaults shown: {seen['spec']['hyperparameters']}"
        assert seen["progress"] == {"step": 0, "total_steps": None}, seen["progress"]
    (listed,) = api.get("/v1/jobs").json()["items"]
    assert listed["spec"]["hyperparameters"] == {} and listed["progress"]["total_steps"] is None, listed
    spec, total = stored(api, job["id"])
    assert spec["hyperparameters"] == {} and total is None, (spec["hyperparameters"], total)
    assert spec["resources"]["processes_per_node"] == 1, "the rest of the spec keeps its defaults"


def test_a_command_that_sets_steps_counts_against_them_and_keeps_only_what_it_sent(api: TestClient) -> None:
    sent = {"steps": 40, "lr": 0.01, "warmup": 3}
    _, job = submitted(api, {**COMMAND, "hyperparameters": sent})
    assert job["spec"]["hyperparameters"] == sent, job["spec"]["hyperparameters"]
    assert job["progress"] == {"step": 0, "total_steps": 40}
    assert stored(api, job["id"]) == (job["spec"] | {"hyperparameters": sent}, 40)


def test_a_command_without_steps_has_no_total_whatever_else_it_sent(api: TestClient) -> None:
    _, job = submitted(api, {**COMMAND, "hyperparameters": {"seed": 7}})
    assert job["spec"]["hyperparameters"] == {"seed": 7}
    assert job["progress"]["total_steps"] is None


def test_an_idempotent_replay_of_a_command_is_the_same_job(api: TestClient) -> None:
    headers = {"Idempotency-Key": "k1"}
    first = api.post("/v1/jobs", json=COMMAND, headers=headers)
    again = api.post("/v1/jobs", json=COMMAND, headers=headers)
    assert first.status_code == 201 and again.status_code == 200, (first.text, again.text)
    assert again.json()["id"] == first.json()["id"]
    other = api.post("/v1/jobs", json={**COMMAND, "hyperparameters": {"steps": 5}}, headers=headers)
    assert other.status_code == 409, "a total sent or not makes another spec"


def test_recipes_and_entrypoints_still_store_every_default() -> None:
    for spec in ({"name": "r", "recipe": "mlp"}, {"name": "e", "entrypoint": "team.plans:build"}):
        hp = JobSpec.model_validate(spec).model_dump(mode="json")["hyperparameters"]
        assert hp["lr"] == 0.05 and hp["steps"] == 100 and hp["global_batch_size"] == 64, hp
        assert JobSpec.model_validate(spec).progress_total == 100


def test_the_stored_command_spec_reads_back_for_the_worker_and_the_event_stream() -> None:
    # The worker validates the stored spec into a JobSpec (its defaults filled in for its own use),
    # and the SSE stream dumps the Job: both start from what the API stored.
    stored_spec = JobSpec.model_validate(COMMAND).model_dump(mode="json")
    spec = JobSpec.model_validate(stored_spec)
    assert spec.hyperparameters.steps == 100 and spec.progress_total is None
    assert spec.model_dump(mode="json") == stored_spec, "a stored spec round-trips unchanged"
    row = JobRow(
        id="j",
        name="script",
        owner_id=1,
        status="succeeded",
        spec=stored_spec,
        step=12,
        total_steps=None,
        attempt=1,
        cancel_requested=False,
        latest_metrics={},
        unplaceable=False,
        created_at=utcnow(),
        updated_at=utcnow(),
    )
    shown = service.to_schema(row, owner="admin").model_dump(mode="json")
    assert shown["spec"]["hyperparameters"] == {} and shown["progress"] == {"step": 12, "total_steps": None}
    assert Job.model_validate(shown).progress.total_steps is None
