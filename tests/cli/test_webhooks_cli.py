"""`dptrain webhooks`: add (the secret printed once), list, deliveries, rm; refusals name the field."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.cli.conftest import dptrain


@pytest.fixture
def sqlite_settings() -> dict[str, str]:
    return {"webhook_allow_networks": "127.0.0.1/32"}


def test_an_admin_manages_webhooks_from_the_cli(api: TestClient) -> None:
    r = dptrain("webhooks", "add", "http://127.0.0.1:9/in", "--event", "failed", "--output", "json")
    assert r.exit_code == 0, r.output
    hook = json.loads(r.stdout)
    assert hook["secret"].startswith("whsec_") and hook["events"] == ["failed"]
    r = dptrain("webhooks", "list")
    assert r.exit_code == 0 and hook["id"][:8] in r.stdout and hook["secret"] not in r.stdout, r.output
    r = dptrain("webhooks", "deliveries", hook["id"], "--output", "json")
    assert r.exit_code == 0 and json.loads(r.stdout) == [], r.output
    r = dptrain("webhooks", "rm", hook["id"])
    assert r.exit_code == 0, r.output
    assert json.loads(dptrain("webhooks", "list", "--output", "json").stdout) == []


def test_a_refused_url_names_the_field(api: TestClient) -> None:
    r = dptrain("webhooks", "add", "http://169.254.169.254/latest/")
    assert r.exit_code == 3 and "url" in r.stderr and "metadata" in r.stderr, r.output
