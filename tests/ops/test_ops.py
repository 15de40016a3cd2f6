"""Readiness and the Prometheus scrape."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session, sessionmaker

from service.app import create_app
from service.config import Settings
from service.db import session_factory
from service.models import Metric
from tests.api_fixtures import RecordingScheduler, submit
from workers.heartbeat import Heartbeat

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
    assert client.get("/metrics", headers={"Authorization": ""}).status_code == 200, "no token needed"
    db.add_all([Metric(job_id=job["id"], attempt=1, name="loss", step=s, value=1.0) for s in range(5)])
    db.commit()
    r = client.get("/metrics", headers={"Authorization": ""})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.headers
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    missing = FAMILIES - set(families)
    assert not missing, f"expected every family, missing {missing}"
    queued = [s.value for s in families["dptrain_jobs"].samples if s.labels == {"status": "queued"}]
    assert queued and queued[0] >= 1, f"expected at least the submitted job queued, got {queued}"
    routes = {s.labels.get("route") for s in families["dptrain_http_request_duration_seconds"].samples}
    assert "/v1/jobs/{job_id}" in routes, f"latency is labelled by route template, got {routes}"
    workers = {s.labels["worker"] for s in families["dptrain_worker_heartbeat_age_seconds"].samples}
    assert "host-m:1" in workers, f"expected the worker's heartbeat age, got {workers}"
    rate = families["dptrain_metric_points_ingested_per_second"].samples[0].value
    assert rate > 0, f"5 points written between two scrapes: expected a positive rate, got {rate}"


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
