"""`dptrain users` on the server host: create prints a working token once, revoke kills it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from dptrain_cli.main import app
from service.config import get_settings
from tests.api_fixtures import as_user


@pytest.fixture
def cli_env(pg_url: str, monkeypatch: pytest.MonkeyPatch, sessions: sessionmaker[Session]) -> Iterator[None]:
    # The CLI opens its own sessions; point them at the test's rolled-back transaction.
    monkeypatch.setenv("DPTRAIN_DATABASE_URL", pg_url)
    get_settings.cache_clear()
    monkeypatch.setattr("dptrain_server.users.session_factory", lambda _settings: sessions)
    yield
    get_settings.cache_clear()


def test_create_then_revoke(cli_env: None, client: TestClient) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["users", "create", "henry", "--admin"])
    assert r.exit_code == 0, f"expected exit 0, got {r.exit_code}: {r.output}"
    token = r.stdout.strip().splitlines()[-1]
    me = client.get("/v1/users/me", headers=as_user(token))
    assert me.status_code == 200 and me.json() == {**me.json(), "name": "henry", "admin": True}, me.text
    again = runner.invoke(app, ["users", "create", "henry"])
    assert again.exit_code == 1 and "already exists" in again.output, f"a taken name fails: {again.output}"
    r = runner.invoke(app, ["users", "revoke", "henry"])
    assert r.exit_code == 0 and "revoked 1" in r.stdout, r.output
    assert client.get("/v1/users/me", headers=as_user(token)).status_code == 401, (
        "a token revoked from the CLI is refused at once"
    )


def test_create_can_run_code_then_grant_and_withdraw(cli_env: None, client: TestClient) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["users", "create", "ivy", "--can-run-code"])
    assert r.exit_code == 0 and "may run code" in r.output, r.output
    ivy = as_user(r.stdout.strip().splitlines()[-1])
    assert client.get("/v1/users/me", headers=ivy).json()["can_run_code"] is True  # now cached
    r = runner.invoke(app, ["users", "grant", "ivy", "--no-can-run-code"])
    assert r.exit_code == 0 and "ivy may not run code" in r.stdout, r.output
    assert client.get("/v1/users/me", headers=ivy).json()["can_run_code"] is False, "at once in this process"
    r = runner.invoke(app, ["users", "grant", "ivy"])
    assert r.exit_code == 0 and "ivy may not run code" in r.stdout, f"no flag changes nothing: {r.output}"
    r = runner.invoke(app, ["users", "grant", "ivy", "--can-run-code"])
    assert r.exit_code == 0 and "ivy may run code" in r.stdout, r.output
    r = runner.invoke(app, ["users", "grant", "nobody", "--can-run-code"])
    assert r.exit_code == 1 and "not found" in r.output, r.output
