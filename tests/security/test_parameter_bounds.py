"""Path and query parameters: every integer has bounds the database can hold, text has no NUL; else a 422."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_schemas.base import INT64_MAX
from service.models import Checkpoint, LogLine, Metric
from service.models.base import utcnow
from service.params import INT32_MAX
from tests.api_fixtures import SPEC
from tests.backends import BACKENDS, client_on, sessions_of


@pytest.fixture(params=BACKENDS)
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    yield from client_on(request, tmp_path)


def _integer_parameters(api: TestClient) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    """(method, path template, where, name, integer schema) of every integer parameter in the OpenAPI."""
    found = []
    for template, operations in api.app.openapi()["paths"].items():  # type: ignore[attr-defined]
        for method, op in operations.items():
            for p in op.get("parameters", []):
                schemas = p["schema"].get("anyOf", [p["schema"]])
                found += [
                    (method, template, p["in"], p["name"], s) for s in schemas if s.get("type") == "integer"
                ]
    return found


def _url(template: str, job_id: str, **path: Any) -> str:
    ids = {"job_id": job_id, "checkpoint_id": 1, "name": "admin", "webhook_id": "w"}
    return template.format(**{**ids, **path})


def _job(api: TestClient) -> str:
    r = api.post("/v1/jobs", json=SPEC)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_every_integer_parameter_is_bounded_in_the_openapi(api: TestClient) -> None:
    params = _integer_parameters(api)
    assert len(params) >= 10, f"the integer parameters: {params}"
    unbounded = [
        (path, name, s)
        for _, path, _, name, s in params
        if not (s.get("minimum", -(2**64)) >= -(2**63) and s.get("maximum", 2**64) <= INT64_MAX)
    ]
    assert unbounded == [], f"integer parameters without bounds a bigint can hold: {unbounded}"


@pytest.mark.parametrize("value", ["9223372036854775808", "1" + "0" * 30, "9" * 5000, "-9223372036854775809"])
def test_an_integer_past_its_bounds_is_a_422_naming_it(api: TestClient, value: str) -> None:
    job_id = _job(api)
    for method, template, where, name, _ in _integer_parameters(api):
        if where == "path":
            url = _url(template, job_id, **{name: value})
        else:
            url = f"{_url(template, job_id)}?{name}={value}"
        # The event stream included: refused before it starts, never cut off in the middle.
        r = api.request(method.upper(), url)
        assert r.status_code == 422, (
            f"{method} {url[:120]}: expected 422, got {r.status_code}: {r.text[:200]}"
        )
        locs = [e["loc"] for e in r.json()["detail"]]
        assert locs == [[where, name]], f"{url[:120]}: {locs}"


def test_the_largest_values_are_answered_without_error(api: TestClient) -> None:
    job_id = _job(api)
    with sessions_of(api).begin() as s:
        s.add_all(
            Metric(job_id=job_id, attempt=1, name="loss", step=i, value=1.0 / (i + 1)) for i in range(40)
        )
        s.add(LogLine(job_id=job_id, attempt=1, rank=0, line="hello"))
        s.add(Checkpoint(job_id=job_id, attempt=1, step=5, path="/nowhere", size_bytes=1, sha256="0" * 64))
    base = f"/v1/jobs/{job_id}"
    empty_series = {"job_id": job_id, "series": {}}
    for url, expected in [
        (f"{base}/metrics?since_step={INT64_MAX}", empty_series),
        (f"{base}/metrics?since_step={INT64_MAX}&max_points=10", empty_series),
        (f"{base}/logs?after={INT64_MAX}", {"items": [], "next_cursor": INT64_MAX}),
        (f"{base}/logs?rank={INT32_MAX}", {"items": [], "next_cursor": None}),
        (f"{base}/logs?rank={INT32_MAX}&tail=5", {"items": [], "next_cursor": None}),
    ]:
        r = api.get(url)
        assert (r.status_code, r.json()) == (200, expected), f"{url}: {r.status_code} {r.text[:200]}"
    r = api.get(f"{base}/checkpoints/{INT64_MAX}/download")
    assert r.status_code == 404, f"a checkpoint id no row has: {r.status_code} {r.text}"
    assert api.post(f"{base}/cancel").status_code == 200
    r = api.get(f"{base}/events?since_step={INT64_MAX}&max_points=10")
    kinds = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
    assert (r.status_code, kinds) == (200, ["job", "checkpoint", "end"]), (
        f"no metrics after it: {r.text[:300]}"
    )


def _cursor_with_nul() -> str:
    raw = json.dumps([utcnow().isoformat(), "\x00"]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize(
    ("method", "url", "loc"),
    [
        ("GET", "/v1/jobs/a%00b", ["path", "job_id"]),
        ("GET", "/v1/jobs/%00/timeline", ["path", "job_id"]),
        ("POST", "/v1/jobs/%00/cancel", ["path", "job_id"]),
        ("GET", "/v1/jobs?label=team%3D%00", ["query", "label", 0]),
        ("POST", "/v1/users/%00/tokens", ["path", "name"]),
        ("DELETE", "/v1/users/%00/tokens", ["path", "name"]),
    ],
)
def test_a_nul_in_path_or_query_text_is_a_422(api: TestClient, method: str, url: str, loc: list[Any]) -> None:
    # PostgreSQL refuses NUL in text even to compare with it: these used to be 500s there.
    r = api.request(method, url)
    assert r.status_code == 422, f"{method} {url}: expected 422, got {r.status_code}: {r.text[:200]}"
    assert [(e["loc"], e["type"]) for e in r.json()["detail"]] == [(loc, "string_nul")], r.text


def test_a_nul_in_a_metric_name_or_a_cursor_is_a_422(api: TestClient) -> None:
    job_id = _job(api)
    r = api.get(f"/v1/jobs/{job_id}/metrics?name=loss,%00")
    assert (r.status_code, r.json()["detail"][0]["loc"]) == (422, ["query", "name"]), r.text
    r = api.get(f"/v1/jobs?cursor={_cursor_with_nul()}")
    assert (r.status_code, r.json()["detail"][0]["loc"]) == (422, ["query", "cursor"]), r.text
