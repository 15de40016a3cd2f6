"""Readiness and the Prometheus scrape (an admin's token or the scrape token; no hosts to the latter)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr, ValidationError
from sqlalchemy.orm import Session, sessionmaker

from service.app import create_app
from service.config import Settings
from service.db import session_factory
from service.models import Metric
from service.models.base import utcnow
from service.nodes import repository as nodes
from tests.api_fixtures import RecordingScheduler, as_user, submit
from tests.backends import BACKENDS, client_on, sessions_of
from workers.node.heartbeat import Heartbeat

FAMILIES = {
    "dptrain_jobs",
    "dptrain_queue_depth",
    "dptrain_job_start_delay_seconds",
    "dptrain_http_request_duration_seconds",
    "dptrain_worker_heartbeat_age_seconds",
    "dptrain_metric_points_ingested_per_second",
}


def test_metrics_has_every_family(client: TestClient, sessions: sessionmaker[Session], db: Session) -> None:
    job = submit(client)
    Heartbeat(
        sessions=sessions, name="host-m:1", address="10.0.0.9", device="cpu", slots=1, interval=5.0
    ).beat()
    client.get(f"/v1/jobs/{job['id']}")
    assert client.get("/metrics").status_code == 200, "an admin's token scrapes"
    db.add_all([Metric(job_id=job["id"], attempt=1, name="loss", step=s, value=1.0) for s in range(5)])
    db.commit()
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.headers
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    missing = FAMILIES - set(families)
    assert not missing, f"expected every family, missing {missing}"
    queued = [s.value for s in families["dptrain_jobs"].samples if s.labels == {"status": "queued"}]
    assert queued and queued[0] >= 1, f"expected at least the submitted job queued, got {queued}"
    routes = {s.labels.get("route") for s in families["dptrain_http_request_duration_seconds"].samples}
    assert "/v1/jobs/{job_id}" in routes, f"latency is labelled by route template, got {routes}"
    workers = {s.labels["worker"] for s in families["dptrain_worker_heartbeat_age_seconds"].samples}
    assert "host-m:1" in workers, (
        f"expected the worker's heartbeat age under its name (an admin), got {workers}"
    )
    rate = families["dptrain_metric_points_ingested_per_second"].samples[0].value
    assert rate > 0, f"5 points written between two scrapes: expected a positive rate, got {rate}"


@pytest.fixture(params=BACKENDS)
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    """An admin's client on PostgreSQL, then on SQLite, with a scrape token set."""
    for c in client_on(request, tmp_path):
        settings: Settings = c.app.state.settings  # type: ignore[attr-defined]
        c.app.state.settings = settings.model_copy(update={"metrics_token": SecretStr(SCRAPE_TOKEN)})  # type: ignore[attr-defined]
        yield c


SCRAPE_TOKEN = "scrape-token-of-prometheus"
# A node named after its host, as a worker is by default, and one named by its operator.
HOST, ADDRESS = "gpu-box-07.cluster.internal", "10.9.8.7"


def beat(api: TestClient, *, name: str, hostname: str, address: str) -> None:
    """A worker node's heartbeat, as `dptrain worker` on that host writes it."""
    with sessions_of(api).begin() as s:
        nodes.heartbeat(
            s,
            name=name,
            hostname=hostname,
            address=address,
            device="cpu",
            device_count=1,
            slots=1,
            now=utcnow(),
        )


def worker_labels(text: str) -> set[str]:
    """The `worker` labels of the heartbeat family in a scrape."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["worker"] for s in families["dptrain_worker_heartbeat_age_seconds"].samples}


class TestScrapeToken:
    def test_without_a_token_or_with_a_users_the_scrape_is_refused(self, api: TestClient) -> None:
        beat(api, name=HOST.split(".")[0], hostname=HOST, address=ADDRESS)
        bare = api.get("/metrics", headers={"Authorization": ""})
        assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer", bare.text
        wrong = api.get("/metrics", headers=as_user(SCRAPE_TOKEN + "x"))
        assert wrong.status_code == 401, wrong.text
        token = api.post("/v1/users", json={"name": "ann"}).json()["token"]
        user = api.get("/metrics", headers=as_user(token))
        assert user.status_code == 403 and "DPTRAIN_METRICS_TOKEN" in user.json()["detail"], user.text
        for r in (bare, wrong, user):
            assert "gpu-box-07" not in r.text and ADDRESS not in r.text, r.text

    def test_the_scrape_token_reads_every_family_and_no_host(self, api: TestClient) -> None:
        beat(api, name=HOST.split(".")[0], hostname=HOST, address=ADDRESS)
        beat(api, name="gpu-a", hostname="gpu-box-08.cluster.internal", address="10.9.8.8")
        r = api.get("/metrics", headers=as_user(SCRAPE_TOKEN))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
        missing = FAMILIES - {f.name for f in text_string_to_metric_families(r.text)}
        assert not missing, f"expected every family, missing {missing}"
        for secret in ("gpu-box-0", ".cluster.internal", "10.9.8."):
            assert secret not in r.text, f"the scrape names a host or address ({secret}): {r.text}"
        token = api.post("/v1/users", json={"name": "ann"}).json()["token"]
        shown = {w["name"] for w in api.get("/v1/workers", headers=as_user(token)).json()["items"]}
        assert worker_labels(r.text) == shown, "each node under the name a non-admin sees in /v1/workers"
        assert "gpu-a" in shown and any(n.startswith("node-") for n in shown), shown
        admin = api.get("/metrics")
        assert admin.status_code == 200 and worker_labels(admin.text) == {"gpu-box-07", "gpu-a"}, (
            "an admin's scrape names nodes as /v1/workers shows them to an admin"
        )

    def test_without_the_setting_only_an_admin_scrapes(self, api: TestClient) -> None:
        settings: Settings = api.app.state.settings  # type: ignore[attr-defined]
        api.app.state.settings = settings.model_copy(update={"metrics_token": None})  # type: ignore[attr-defined]
        assert api.get("/metrics", headers=as_user(SCRAPE_TOKEN)).status_code == 401
        assert api.get("/metrics").status_code == 200

    def test_a_short_scrape_token_is_refused_at_start(self, tmp_path: Path) -> None:
        with pytest.raises(ValidationError, match="DPTRAIN_METRICS_TOKEN must be at least 16 characters"):
            Settings(home=tmp_path, metrics_token="short")  # type: ignore[arg-type]
        assert Settings(home=tmp_path, metrics_token="").metrics_token is None, "empty: unset (compose)"  # type: ignore[arg-type]


def test_readyz_is_200_with_database_and_broker(client: TestClient) -> None:
    r = client.get("/readyz", headers={"Authorization": ""})
    assert r.status_code == 200 and r.json() == {"status": "ready"}, (
        f"expected ready, got {r.status_code} {r.text}"
    )


def test_readyz_is_503_naming_what_failed(settings: Settings, sessions: sessionmaker[Session]) -> None:
    closed = settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
    app = create_app(closed, scheduler=RecordingScheduler())
    app.state.session_factory = sessions
    with TestClient(app) as c:
        r = c.get("/readyz")
        assert r.status_code == 503, f"expected 503 with the broker down, got {r.status_code}"
        assert r.json() == {"status": "unavailable", "failed": ["broker"]}, r.json()
        app.state.session_factory = session_factory(
            settings.model_copy(update={"database_url": "postgresql+psycopg://postgres@127.0.0.1:1/none"})
        )
        r = c.get("/readyz")
        assert r.json() == {"status": "unavailable", "failed": ["database", "broker"]}, r.json()
        assert c.get("/healthz").status_code == 200, "liveness stays 200 whatever the dependencies"
