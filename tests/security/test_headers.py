"""Security headers: nosniff on every answer, the dashboard's CSP on every HTML page, tokens never cached."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.headers import DASHBOARD_CSP, DOCS_CSP
from tests.api_fixtures import RecordingScheduler, submit
from tests.backends import sqlite_app


class TestHeaders:
    @pytest.mark.parametrize("path", ["/", "/static/index.html"])
    def test_every_dashboard_page_carries_the_csp_and_nosniff(self, client: TestClient, path: str) -> None:
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.headers
        assert r.headers.get("content-security-policy") == DASHBOARD_CSP, f"{path}: {r.headers}"
        assert "frame-ancestors 'none'" in DASHBOARD_CSP
        assert r.headers.get("x-content-type-options") == "nosniff", f"{path}: {r.headers}"
        assert r.headers.get("referrer-policy") == "no-referrer", f"{path}: {r.headers}"

    @pytest.mark.parametrize(
        ("method", "path", "status"),
        [
            ("GET", "/v1/jobs", 200),
            ("GET", "/v1/jobs/nope", 404),
            ("GET", "/v1/jobs?limit=0", 422),
            ("GET", "/openapi.json", 200),
            ("GET", "/static/app.js", 200),
        ],
    )
    def test_every_answer_carries_nosniff(
        self, client: TestClient, method: str, path: str, status: int
    ) -> None:
        r = client.request(method, path)
        assert r.status_code == status, r.text
        assert r.headers.get("x-content-type-options") == "nosniff", f"{method} {path}: {r.headers}"
        refused = client.get("/v1/jobs", headers={"Authorization": "Bearer nope"})
        assert refused.status_code == 401 and refused.headers.get("x-content-type-options") == "nosniff"

    def test_answers_carrying_a_token_are_never_stored(self, client: TestClient) -> None:
        created = client.post("/v1/users", json={"name": "carol"})
        assert created.status_code == 201 and created.json()["token"], created.text
        assert created.headers.get("cache-control") == "no-store", created.headers
        issued = client.post("/v1/users/carol/tokens")
        assert issued.status_code == 201 and issued.json()["token"], issued.text
        assert issued.headers.get("cache-control") == "no-store", issued.headers
        # A job poll keeps its own rule: stored, but revalidated with its ETag.
        job = client.get(f"/v1/jobs/{submit(client)['id']}")
        assert job.headers.get("cache-control") == "no-cache", job.headers


class TestApiDocs:
    def test_docs_are_off_by_default_outside_the_embedded_service(self, client: TestClient) -> None:
        for path in ("/docs", "/redoc"):
            assert client.get(path).status_code == 404, f"expected {path} off on PostgreSQL by default"
        assert client.get("/openapi.json").status_code == 200, "the schema stays available"

    def test_the_embedded_service_serves_them_under_their_own_csp(self, tmp_path: Path) -> None:
        with sqlite_app(tmp_path) as api:
            for path in ("/docs", "/redoc"):
                r = api.get(path)
                assert r.status_code == 200, f"expected {path} on for the embedded service: {r.status_code}"
                assert r.headers.get("content-security-policy") == DOCS_CSP, f"{path}: {r.headers}"
                assert r.headers.get("x-content-type-options") == "nosniff", r.headers

    def test_a_setting_turns_them_on_or_off(self, settings: Settings) -> None:
        on = TestClient(
            create_app(settings.model_copy(update={"api_docs": True}), scheduler=RecordingScheduler())
        )
        assert on.get("/docs").status_code == 200
        assert Settings(database_url="sqlite:///x.db", api_docs=False).api_docs is False
        assert Settings(database_url="sqlite:///x.db").api_docs is True
        assert Settings(database_url="postgresql+psycopg://u@h/d").api_docs is False
