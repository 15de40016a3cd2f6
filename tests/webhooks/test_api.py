"""`/v1/webhooks`: admins only, the secret shown once, no URL that reaches the service or metadata."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from api_schemas import JobStatus
from service.config import Settings
from service.jobs import lifecycle
from service.models import WebhookDelivery
from tests.api_fixtures import add_user, as_user, submit
from tests.webhooks.addresses import REFUSED_FORMS, own_address, resolving, url_host


@pytest.fixture
def settings(settings: Settings) -> Settings:
    # A receiver on this host may be registered; everything else refused stays refused.
    return settings.model_copy(update={"webhook_allow_networks": "127.0.0.1/32"})


def _register(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/hook", **body})
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_the_secret_is_shown_once(client: TestClient) -> None:
    created = _register(client, events=["succeeded", "failed"])
    assert created["secret"].startswith("whsec_") and len(created["secret"]) > 40
    assert created["events"] == ["failed", "succeeded"] and created["owner"] is None
    listed = client.get("/v1/webhooks").json()["items"]
    assert [h["id"] for h in listed] == [created["id"]]
    assert "secret" not in listed[0]
    assert created["secret"] not in client.get("/v1/webhooks").text
    assert client.get(f"/v1/webhooks/{created['id']}/deliveries").json() == {"items": []}


def test_non_admins_are_refused(client: TestClient, db: Session) -> None:
    user = as_user(add_user(db, "bob"))
    created = _register(client)
    for method, path in [
        ("POST", "/v1/webhooks"),
        ("GET", "/v1/webhooks"),
        ("DELETE", f"/v1/webhooks/{created['id']}"),
        ("GET", f"/v1/webhooks/{created['id']}/deliveries"),
    ]:
        body = {"url": "http://127.0.0.1:9/hook"} if method == "POST" else None
        r = client.request(method, path, json=body, headers=user)
        assert r.status_code == 403, (method, path, r.text)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://169.254.169.254/latest/meta-data/", "link-local, metadata"),
        ("http://[fd00:ec2::254]/", "metadata"),
        ("http://[fe80::1]:8080/", "link-local"),
        ("http://0.0.0.0:8000/", "unspecified"),
        ("http://127.0.0.2:8000/", "loopback"),
        ("http://[::1]:8000/", "loopback"),
        ("http://[::ffff:169.254.169.254]/", "metadata"),
        ("ftp://127.0.0.1/", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
        ("http://user:pw@127.0.0.1/", "credentials"),
        ("http:///nohost", "no host"),
        ("http://no-such-host.invalid/", "does not resolve"),
    ],
)
def test_urls_that_reach_the_service_or_metadata_are_refused(client: TestClient, url: str, why: str) -> None:
    r = client.post("/v1/webhooks", json={"url": url})
    assert r.status_code == 422, r.text
    [error] = r.json()["detail"]
    assert error["loc"] == ["body", "url"] and why in error["msg"], error


def test_loopback_is_refused_without_the_setting(client: TestClient) -> None:
    client.app.state.settings = client.app.state.settings.model_copy(update={"webhook_allow_networks": ""})  # type: ignore[attr-defined]
    r = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:8000/hook"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "url"], r.text
    assert "DPTRAIN_WEBHOOK_ALLOW_NETWORKS" in r.json()["detail"][0]["msg"]


def _allowing(client: TestClient, networks: str) -> None:
    settings = client.app.state.settings  # type: ignore[attr-defined]
    client.app.state.settings = settings.model_copy(update={"webhook_allow_networks": networks})  # type: ignore[attr-defined]


def _refused(client: TestClient, url: str) -> str:
    r = client.post("/v1/webhooks", json={"url": url})
    assert r.status_code == 422, (url, r.text)
    [error] = r.json()["detail"]
    assert error["loc"] == ["body", "url"], error
    return str(error["msg"])


@pytest.mark.parametrize(("address", "why"), REFUSED_FORMS)
def test_every_form_of_a_refused_address_is_refused(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, address: str, why: str
) -> None:
    _allowing(client, "")
    assert why in _refused(client, f"http://{url_host(address)}:8080/hook")
    with resolving(monkeypatch, {"hooks.example.test": address}):
        assert why in _refused(client, "http://hooks.example.test:8080/hook")
    assert client.get("/v1/webhooks").json()["items"] == []


def test_metadata_google_internal_is_refused_by_its_address(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    with resolving(monkeypatch, {"metadata.google.internal": "169.254.169.254"}):
        assert "169.254.169.254 is a loopback, link-local, metadata" in _refused(
            client, "http://metadata.google.internal/computeMetadata/v1/"
        )


def test_every_address_of_this_host_is_refused(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    # An address of an interface, whatever this host's name resolves to (here: 127.0.0.1 only).
    address = own_address()
    assert "own host" in _refused(client, f"http://{url_host(address)}:8000/hook")
    with resolving(monkeypatch, {"hooks.example.test": address}):
        assert "own host" in _refused(client, "http://hooks.example.test:8000/hook")
    if ":" not in address:
        assert f"carries {address}" in _refused(client, f"http://[::ffff:{address}]:8000/hook")


def test_allowed_networks_still_allow(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    address = own_address()
    _allowing(client, f"100.100.100.200/32,169.254.169.254/32,{address}/{32 if ':' not in address else 128}")
    for host in ("100.100.100.200", "[64:ff9b::a9fe:a9fe]", "[2002:a9fe:a9fe::]", url_host(address)):
        r = client.post("/v1/webhooks", json={"url": f"http://{host}:8080/hook"})
        assert r.status_code == 201, (host, r.text)
    with resolving(monkeypatch, {"hooks.example.test": "::ffff:0:a9fe:a9fe"}):
        r = client.post("/v1/webhooks", json={"url": "http://hooks.example.test/hook"})
        assert r.status_code == 201, r.text
    # What the setting does not name stays refused.
    assert "carries 127.0.0.1" in _refused(client, "http://[64:ff9b::7f00:1]/")


def test_bad_fields_are_named(client: TestClient) -> None:
    r = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/", "events": ["exploded"]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][:2] == ["body", "events"], r.text
    r = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/", "owner": "nobody"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "owner"], r.text
    assert client.delete("/v1/webhooks/feedface").status_code == 404
    assert client.get("/v1/webhooks/feedface/deliveries").status_code == 404


def test_each_state_change_writes_a_delivery_per_matching_webhook(client: TestClient, db: Session) -> None:
    add_user(db, "carol")
    everything = _register(client)
    only_cancelled = _register(client, events=["cancelled"])
    carols = _register(client, owner="carol")
    job = submit(client)
    assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code in (200, 202)
    rows = db.scalars(select(WebhookDelivery).where(WebhookDelivery.job_id == job["id"])).all()
    got = sorted((r.webhook_id, r.event) for r in rows)
    assert got == sorted(
        [(everything["id"], "queued"), (everything["id"], "cancelled"), (only_cancelled["id"], "cancelled")]
    )
    assert not any(r.webhook_id == carols["id"] for r in rows)
    cancelled = next(r for r in rows if r.webhook_id == only_cancelled["id"])
    assert cancelled.payload["from"] == "queued" and cancelled.payload["to"] == "cancelled"
    assert cancelled.payload["owner"] == "admin" and cancelled.payload["job_id"] == job["id"]
    listed = client.get(f"/v1/webhooks/{everything['id']}/deliveries").json()["items"]
    assert {d["event"] for d in listed} == {"queued", "cancelled"}
    assert all(d["status"] == "pending" and d["attempts"] == 0 for d in listed)
    assert client.delete(f"/v1/webhooks/{everything['id']}").status_code == 204
    assert client.get(f"/v1/webhooks/{everything['id']}/deliveries").status_code == 404


def test_a_worker_s_transition_carries_the_job_s_error(client: TestClient, db: Session) -> None:
    hook = _register(client, events=["failed"])
    job = submit(client)
    assert lifecycle.claim(db, job_id=job["id"], worker="w1") is not None
    error = {"type": "ValueError", "message": "bad batch", "rank": 1}
    done = lifecycle.transition(
        db,
        job_id=job["id"],
        src=JobStatus.RUNNING,
        dst=JobStatus.FAILED,
        reason="rank 1 failed",
        values={"error": error},
    )
    assert done is not None
    db.commit()
    [row] = db.scalars(select(WebhookDelivery).where(WebhookDelivery.webhook_id == hook["id"])).all()
    assert row.payload["error"] == error and row.payload["reason"] == "rank 1 failed"
    assert (row.payload["from"], row.payload["to"], row.payload["attempt"]) == ("running", "failed", 1)
