"""Deliveries to a real receiver on 127.0.0.1, through Redis and an in-process webhook worker (threads)."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from fastapi.testclient import TestClient
from sqlalchemy.orm import sessionmaker

from service.app import create_app
from service.config import Settings
from service.db import get_engine, session_factory
from service.scheduling.service import schedule_once
from service.webhooks.publisher import publisher_for
from service.webhooks.sweep import sweep_once
from service.webhooks.worker import create_app as create_webhook_app
from tests.api_fixtures import ADMIN_TOKEN, RecordingDispatcher, RecordingScheduler, register_node, submit
from tests.conftest import REDIS_URL, free_port
from tests.webhooks.receiver import Receiver


@pytest.fixture(scope="module")
def settings(own_database: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(
        database_url=own_database,
        broker_url=REDIS_URL,
        # A queue of this module's own on the shared Redis.
        queue=f"dptrain-test-{uuid.uuid4().hex[:8]}",
        artifact_root=tmp_path_factory.mktemp("artifacts"),
        bootstrap_token=ADMIN_TOKEN,  # type: ignore[arg-type]
        poll_cache=False,
        webhook_allow_networks="127.0.0.1/32",
        webhook_backoff_seconds=0.2,
        webhook_backoff_max_seconds=0.5,
        webhook_max_attempts=1000,
        webhook_timeout_seconds=120,
    )


@pytest.fixture(scope="module")
def worker(settings: Settings) -> Iterator[None]:
    """The webhook worker, consuming the module's webhook queue from Redis."""
    app = create_webhook_app(settings)
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, shutdown_timeout=30):
        yield


@pytest.fixture
def client(settings: Settings, worker: None) -> Iterator[TestClient]:
    app = create_app(settings, scheduler=RecordingScheduler())
    with TestClient(app, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
        yield c
        # Each test starts with no webhook and no queued job of another test to place.
        for hook in c.get("/v1/webhooks").json()["items"]:
            c.delete(f"/v1/webhooks/{hook['id']}")
        for job in c.get("/v1/jobs", params={"status": "queued"}).json()["items"]:
            c.post(f"/v1/jobs/{job['id']}/cancel")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(port=free_port())
    yield r
    r.stop()


def _register(client: TestClient, port: int) -> dict[str, Any]:
    r = client.post("/v1/webhooks", json={"url": f"http://127.0.0.1:{port}/hooks?x=1"})
    assert r.status_code == 201, r.text
    return dict(r.json())


def _until(check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {check}")


def _deliveries(client: TestClient, hook: dict[str, Any]) -> list[dict[str, Any]]:
    return list(client.get(f"/v1/webhooks/{hook['id']}/deliveries").json()["items"])


def _all_delivered(client: TestClient, hook: dict[str, Any], count: int) -> list[dict[str, Any]]:
    def done() -> list[dict[str, Any]] | None:
        items = _deliveries(client, hook)
        return items if len(items) == count and all(d["status"] == "delivered" for d in items) else None

    return list(_until(done))


def test_the_signature_verifies_with_the_documented_recipe(client: TestClient, receiver: Receiver) -> None:
    hook = _register(client, receiver.start().port)
    job = submit(client)
    [got] = receiver.wait_for(1)
    # docs/api.md#webhooks: HMAC-SHA256 of `<Dptrain-Timestamp>.<raw body>` with the secret, hex, after `v1=`.
    timestamp = got.headers["Dptrain-Timestamp"]
    expected = hmac.new(hook["secret"].encode(), timestamp.encode() + b"." + got.body, hashlib.sha256)
    assert hmac.compare_digest("v1=" + expected.hexdigest(), got.headers["Dptrain-Signature"])
    assert abs(time.time() - int(timestamp)) < 300
    forged = hmac.new(b"not-the-secret", timestamp.encode() + b"." + got.body, hashlib.sha256)
    assert not hmac.compare_digest("v1=" + forged.hexdigest(), got.headers["Dptrain-Signature"])
    event = json.loads(got.body)
    assert event["job_id"] == job["id"] and event["owner"] == "admin" and event["name"] == job["name"]
    assert (event["from"], event["to"], event["error"]) == (None, "queued", None)
    assert got.headers["Dptrain-Delivery"] == event["delivery_id"]
    assert got.headers["Dptrain-Event"] == "queued"
    [listed] = _all_delivered(client, hook, 1)
    assert (listed["id"], listed["last_status_code"], listed["attempts"]) == (event["delivery_id"], 204, 1)


def test_a_receiver_down_for_a_while_gets_every_event_once_it_is_back(
    client: TestClient, receiver: Receiver
) -> None:
    hook = _register(client, receiver.port)  # nobody listens there yet
    job = submit(client)
    assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code in (200, 202)

    def retried() -> bool:
        items = _deliveries(client, hook)
        return len(items) == 2 and all(d["attempts"] >= 3 and d["status"] == "pending" for d in items)

    _until(retried)
    assert all("ConnectError" in (d["last_error"] or "") for d in _deliveries(client, hook))
    receiver.start()
    listed = _all_delivered(client, hook, 2)
    received = {json.loads(r.body)["delivery_id"]: json.loads(r.body) for r in receiver.wait_for(2)}
    assert received.keys() == {d["id"] for d in listed}
    assert sorted(e["to"] for e in received.values()) == ["cancelled", "queued"]


def test_a_slow_receiver_delays_neither_the_api_nor_placement(
    client: TestClient, receiver: Receiver, settings: Settings
) -> None:
    receiver.start().hold.clear()  # every answer waits until the test lets it go
    hook = _register(client, receiver.port)
    register_node(session_factory(settings), name="slow-receiver-node", slots=4)
    first = submit(client)
    receiver.wait_for(1)  # the first delivery is with the receiver, unanswered
    second = submit(client)
    assert client.post(f"/v1/jobs/{second['id']}/cancel").status_code in (200, 202)
    dispatcher = RecordingDispatcher()
    schedule_once(sessions=session_factory(settings), dispatcher=dispatcher, settings=settings)
    assert dispatcher.sent == [first["id"]]
    assert client.get(f"/v1/jobs/{first['id']}").json()["status"] == "running"
    # All of that answered while the receiver still held its first request.
    assert not receiver.hold.is_set() and len(_deliveries(client, hook)) == 4
    receiver.hold.set()
    listed = _all_delivered(client, hook, 4)
    assert sorted((d["job_id"], d["event"]) for d in listed) == sorted(
        [
            (first["id"], "queued"),
            (first["id"], "running"),
            (second["id"], "queued"),
            (second["id"], "cancelled"),
        ]
    )


def test_a_hanging_receiver_delays_no_other_receiver(client: TestClient, settings: Settings) -> None:
    hanging, healthy = Receiver(port=free_port()).start(), Receiver(port=free_port()).start()
    hanging.hold.clear()  # every answer waits until the test lets it go (the POST's timeout is 120 s)
    try:
        _register(client, hanging.port)
        for _ in range(6):  # more deliveries to it than the worker has threads (4)
            submit(client)
        hanging.wait_for(1)
        time.sleep(1.0)  # the worker takes up what it will of that backlog
        hook = _register(client, healthy.port)
        job = submit(client)
        # Delivered while every request to the hanging receiver is still unanswered.
        [got] = healthy.wait_for(1, timeout=15)
        assert json.loads(got.body)["job_id"] == job["id"]
        _until(lambda: [d["status"] for d in _deliveries(client, hook)] == ["delivered"], timeout=15)
        assert not hanging.hold.is_set()
        # Its other deliveries wait their turn, not in a thread.
        assert len(hanging.received) <= settings.webhook_sends_per_receiver, len(hanging.received)
    finally:
        hanging.stop()
        healthy.stop()


def test_the_sweep_sends_what_a_lost_publish_left_pending(
    client: TestClient, receiver: Receiver, settings: Settings
) -> None:
    hook = _register(client, receiver.start().port)
    # A process that died between its commit and its publish: the row is there, no message is.
    client.app.state.session_factory = sessionmaker(bind=get_engine(settings), expire_on_commit=False)  # type: ignore[attr-defined]
    job = submit(client)
    [pending] = _deliveries(client, hook)
    assert pending["status"] == "pending" and pending["attempts"] == 0
    assert sweep_once(sessions=session_factory(settings), publish=publisher_for(settings).send) >= 1
    [got] = receiver.wait_for(1)
    assert json.loads(got.body)["job_id"] == job["id"]
    _all_delivered(client, hook, 1)


def test_the_webhook_worker_module_needs_no_node(settings: Settings, tmp_path: Path) -> None:
    # The webhook worker's app registers only its task: no heartbeat, no placement of its own.
    app = create_webhook_app(settings)
    assert "dptrain.deliver_webhook" in app.tasks and "dptrain.run_node" not in app.tasks
