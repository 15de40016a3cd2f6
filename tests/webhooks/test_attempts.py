"""One delivery attempt at a time, on the embedded service's SQLite: retries, giving up, DNS rebinding."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.models.base import utcnow
from service.webhooks import repository
from service.webhooks.delivery import backoff, deliver
from tests.api_fixtures import submit
from tests.backends import sessions_of, sqlite_app
from tests.conftest import free_port
from tests.webhooks.addresses import REFUSED_FORMS, own_address, resolving, url_host
from tests.webhooks.receiver import Receiver

OPTIONS: dict[str, Any] = {
    "webhook_allow_networks": "127.0.0.1/32",
    "webhook_backoff_seconds": 0.001,
    "webhook_max_attempts": 3,
}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with sqlite_app(tmp_path, **OPTIONS) as c:
        yield c


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(port=free_port())
    yield r
    r.stop()


def _settings(client: TestClient) -> Settings:
    settings: Settings = client.app.state.settings  # type: ignore[attr-defined]
    return settings


def _attempt(client: TestClient, hook: dict[str, Any]) -> list[dict[str, Any]]:
    """One attempt at each pending delivery of `hook` (the task's work, without the broker)."""
    items = client.get(f"/v1/webhooks/{hook['id']}/deliveries").json()["items"]
    for d in items:
        deliver(sessions=sessions_of(client), settings=_settings(client), delivery_id=d["id"])
    return list(client.get(f"/v1/webhooks/{hook['id']}/deliveries").json()["items"])


def test_backoff_doubles_up_to_its_cap() -> None:
    settings = Settings(webhook_backoff_seconds=2, webhook_backoff_max_seconds=10)
    assert [backoff(n, settings=settings) for n in (1, 2, 3, 4, 5)] == [2, 4, 8, 10, 10]


def test_failures_are_retried_then_given_up_and_a_delivery_is_sent_once(
    client: TestClient, receiver: Receiver
) -> None:
    hook = client.post("/v1/webhooks", json={"url": f"http://127.0.0.1:{receiver.port}/"}).json()
    submit(client)
    [first] = _attempt(client, hook)  # nobody listens yet
    assert (first["status"], first["attempts"]) == ("pending", 1) and "ConnectError" in first["last_error"]
    receiver.start()
    [second] = _attempt(client, hook)
    assert (second["status"], second["attempts"], second["last_status_code"]) == ("delivered", 2, 204)
    [again] = _attempt(client, hook)  # a duplicate task finds nothing to send
    assert again["attempts"] == 2 and len(receiver.received) == 1
    receiver.stop()
    submit(client)
    for _ in range(OPTIONS["webhook_max_attempts"] + 1):
        newest = _attempt(client, hook)[0]
    assert (newest["status"], newest["attempts"], newest["next_attempt_at"]) == ("failed", 3, None)


def test_the_address_is_checked_again_at_delivery(
    client: TestClient, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver.start()
    real = socket.getaddrinfo
    points_at = {"hooks.example.test": "127.0.0.1"}

    def resolve(host: str, *args: Any, **kwargs: Any) -> Any:
        if host in points_at:
            return real(points_at[host], *args, **kwargs)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    url = f"http://hooks.example.test:{receiver.port}/in"
    hook = client.post("/v1/webhooks", json={"url": url}).json()
    submit(client)
    points_at["hooks.example.test"] = "169.254.169.254"  # DNS rebinding, after registration
    [refused] = _attempt(client, hook)
    assert refused["status"] == "pending" and "refused: 169.254.169.254" in refused["last_error"]
    assert receiver.received == []
    points_at["hooks.example.test"] = "127.0.0.1"
    [sent] = _attempt(client, hook)
    assert sent["status"] == "delivered"
    [got] = receiver.received
    # Sent to the address just checked, under the name the URL gave.
    assert got.headers["Host"] == f"hooks.example.test:{receiver.port}"
    assert json.loads(got.body)["to"] == "queued"


def test_a_delivery_whose_sender_died_is_sent_once_its_lease_ends(
    client: TestClient, receiver: Receiver
) -> None:
    hook = client.post("/v1/webhooks", json={"url": f"http://127.0.0.1:{receiver.start().port}/"}).json()
    submit(client)
    [pending] = client.get(f"/v1/webhooks/{hook['id']}/deliveries").json()["items"]
    with sessions_of(client).begin() as session:
        # A sender claimed it, then died before sending; its lease has run out.
        claimed = repository.claim(session, delivery_id=pending["id"], now=utcnow(), lease_seconds=-1)
    assert claimed is not None and claimed.attempts == 1
    [sent] = _attempt(client, hook)
    assert (sent["status"], sent["attempts"]) == ("delivered", 2) and len(receiver.received) == 1


def test_every_form_of_a_refused_address_is_refused_before_sending(
    tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver.start()
    refused = [*REFUSED_FORMS, (own_address(), "own host")]
    # Each named host led to an allowed receiver at registration; each literal one was registered
    # while the setting allowed everything. Both lead to a refused address now, allowed by nothing.
    names = {f"h{i}.example.test": "127.0.0.1" for i in range(len(refused))}
    with resolving(monkeypatch, names), sqlite_app(tmp_path, **OPTIONS) as c:
        c.app.state.settings = _settings(c).model_copy(update={"webhook_allow_networks": "0.0.0.0/0,::/0"})  # type: ignore[attr-defined]
        hooks: dict[str, tuple[str, str]] = {}
        for i, (address, why) in enumerate(refused):
            for url in (
                f"http://{url_host(address)}:{receiver.port}/",
                f"http://h{i}.example.test:{receiver.port}/",
            ):
                r = c.post("/v1/webhooks", json={"url": url})
                assert r.status_code == 201, r.text
                hooks[r.json()["id"]] = (url, why)
        submit(c)
        for i, (address, _) in enumerate(refused):
            names[f"h{i}.example.test"] = address
        now = _settings(c).model_copy(update={"webhook_allow_networks": "", "webhook_timeout_seconds": 2})
        for hook_id, (url, why) in hooks.items():
            [pending] = c.get(f"/v1/webhooks/{hook_id}/deliveries").json()["items"]
            deliver(sessions=sessions_of(c), settings=now, delivery_id=pending["id"])
            [tried] = c.get(f"/v1/webhooks/{hook_id}/deliveries").json()["items"]
            assert tried["status"] == "pending" and tried["last_error"].startswith("refused: "), (url, tried)
            assert why in tried["last_error"], (url, tried)
    assert receiver.received == []
