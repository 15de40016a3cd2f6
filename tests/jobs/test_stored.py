"""A row whose spec, error or metrics no longer validate is still listed, shown, cancellable, and says why."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import text

from api_schemas import JobSpec
from service.jobs import stored
from tests.api_fixtures import SPEC
from tests.backends import BACKENDS, client_on, sessions_of, store_raw


@pytest.fixture(params=BACKENDS)
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    yield from client_on(request, tmp_path)


def _stored_spec(api: TestClient, **over: Any) -> tuple[str, dict[str, Any]]:
    job = api.post("/v1/jobs", json=SPEC).json()
    return job["id"], {**job["spec"], **over}


class TestShownThroughTheApi:
    @pytest.mark.parametrize(
        ("over", "field"),
        [
            # 1e999 is a number JSONB and SQLite keep; Python reads it back as infinity.
            ({"hyperparameters": {"lr": "__1e999__", "steps": 4}}, "hyperparameters.lr"),
            ({"resources": {"nodes": "two"}}, "resources.nodes"),
            ({"added_in_a_later_version": True}, "added_in_a_later_version"),
            ({"labels": {"team": ["a", "list"]}}, "labels.team"),
            # A variable name refused since (issue 30): the key's error, the rest of the spec shown.
            ({"env": {"CXX": "/bin/bash", "MY_FLAG": "1"}}, "env.CXX.[key]"),
        ],
    )
    def test_listed_shown_and_cancelled_with_the_reason(
        self, api: TestClient, over: dict[str, Any], field: str
    ) -> None:
        job_id, spec = _stored_spec(api, **over)
        store_raw(api, job_id=job_id, column="spec", raw=json.dumps(spec).replace('"__1e999__"', "1e999"))
        r = api.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, f"GET of the job: {r.status_code} {r.text[:300]}"
        job = r.json()
        assert (job["status"], job["error"]["type"]) == ("queued", "InvalidSpec"), job
        assert f"{field}:" in job["error"]["message"], f"names {field}: {job['error']['message']}"
        assert (job["spec"]["name"], job["spec"]["recipe"]) == ("mlp-smoke", "mlp"), "the rest is shown"
        listed = api.get("/v1/jobs")
        assert listed.status_code == 200, f"the list holding it: {listed.status_code} {listed.text[:300]}"
        assert [j["id"] for j in listed.json()["items"]] == [job_id]
        cancelled = api.post(f"/v1/jobs/{job_id}/cancel")
        assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled"), cancelled.text
        r = api.get(f"/v1/jobs/{job_id}/events")
        assert r.status_code == 200 and "event: end" in r.text, r.text[:300]

    def test_an_error_or_metrics_that_do_not_validate(self, api: TestClient) -> None:
        job_id, _ = _stored_spec(api)
        store_raw(api, job_id=job_id, column="error", raw=json.dumps({"kind": "old shape"}))
        store_raw(api, job_id=job_id, column="latest_metrics", raw=json.dumps({"loss": "low", "acc": 0.5}))
        r = api.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text[:300]
        job = r.json()
        assert job["error"]["type"] == "InvalidError" and "old shape" in job["error"]["message"], job["error"]
        assert job["latest_metrics"] == {"acc": 0.5}, job["latest_metrics"]


class TestShownSpec:
    def test_a_valid_spec_is_shown_as_it_is(self) -> None:
        spec, problem = stored.shown_spec(JobSpec(name="a", recipe="mlp").model_dump(mode="json"), name="a")
        assert (spec, problem) == (JobSpec(name="a", recipe="mlp"), None)

    def test_the_fields_that_fail_are_left_out(self) -> None:
        raw = {
            "name": "a",
            "recipe": "mlp",
            "hyperparameters": {"lr": float("inf"), "steps": 7},
            "labels": {"k": "v"},
            "x": 1,
        }
        spec, problem = stored.shown_spec(raw, name="a")
        assert (spec.hyperparameters.lr, spec.hyperparameters.steps, spec.labels) == (0.05, 7, {"k": "v"})
        assert problem is not None and "hyperparameters.lr:" in problem and "x: Extra inputs" in problem

    @pytest.mark.parametrize("raw", ["not json at all", [1, 2], None, {"name": "bad name!"}, {}])
    def test_what_cannot_be_saved_shows_the_job_name_and_defaults(self, raw: Any) -> None:
        spec, problem = stored.shown_spec(raw, name="from-the-row")
        assert problem is not None
        assert spec.model_dump(mode="json")["name"] in ("from-the-row", "bad name!")

    def test_describe_names_a_few_fields_and_counts_the_rest(self) -> None:
        with pytest.raises(ValidationError) as caught:
            JobSpec.model_validate({"name": "", "a": 1, "b": 2, "c": 3})
        assert stored.describe(caught.value, limit=2).endswith("(and 2 more)"), stored.describe(caught.value)


def test_a_stored_non_finite_point_is_left_out_of_the_event_stream(client: TestClient) -> None:
    # Only a hand can store one (the reporter refuses them), but the stream must stay JSON.
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    with sessions_of(client).begin() as s:
        rows = [(1, 0.5), (2, float("nan")), (3, float("inf")), (4, 0.25)]
        s.execute(
            text("INSERT INTO metrics (job_id, attempt, name, step, value) VALUES (:j, 1, 'loss', :s, :v)"),
            [{"j": job_id, "s": step, "v": value} for step, value in rows],
        )
    client.post(f"/v1/jobs/{job_id}/cancel")  # a terminal job: the stream ends
    r = client.get(f"/v1/jobs/{job_id}/events")
    assert r.status_code == 200, r.text[:300]

    def refuse(token: str) -> None:
        raise AssertionError(f"non-JSON number {token} in a frame: {r.text[:500]}")

    frames = [
        json.loads(line[6:], parse_constant=refuse)
        for line in r.text.splitlines()
        if line.startswith("data: ")
    ]
    points = [p for f in frames for p in f.get("series", {}).get("loss", [])]
    assert points == [[1, 0.5], [4, 0.25]], points
