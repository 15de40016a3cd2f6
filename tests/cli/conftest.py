"""The CLI in-process against the real app on SQLite, or against a hand-written server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner, Result

from dptrain.client import Client
from dptrain_cli.main import app
from tests.conftest import job_spec


def use_http(monkeypatch: pytest.MonkeyPatch, http: httpx.Client) -> None:
    """Make every `Client.from_env()` of the CLI talk through `http`."""

    def from_env(cls: type[Client]) -> Client:
        client = cls("http://testserver", token="", http=http)
        # The test's connection serves every command it runs: a command's close must not end it.
        client.close = lambda: None  # type: ignore[method-assign]
        return client

    monkeypatch.setattr(Client, "from_env", classmethod(from_env))


@pytest.fixture
def api(sqlite_client: TestClient, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    """The app on SQLite, which the CLI's client reaches in-process, as an admin."""
    use_http(monkeypatch, sqlite_client)
    return sqlite_client


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, httpx.Response]], list[str]]:
    """Point the CLI at a server answering each method as given (else 500); the methods it was sent."""

    def serve(answers: dict[str, httpx.Response]) -> list[str]:
        calls: list[str] = []

        def server(request: httpx.Request) -> httpx.Response:
            calls.append(request.method)
            return answers.get(request.method, httpx.Response(500))

        use_http(
            monkeypatch, httpx.Client(base_url="http://testserver", transport=httpx.MockTransport(server))
        )
        return calls

    return serve


@pytest.fixture
def spec_file(tmp_path: Path) -> Callable[..., Path]:
    """Write `job_spec(**overrides)` as a YAML job file; its path."""

    def write(**overrides: Any) -> Path:
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(job_spec(**overrides)))
        return path

    return write


def dptrain(*args: str | Path) -> Result:
    """Run `dptrain ARGS` in-process."""
    return CliRunner().invoke(app, [str(a) for a in args])


def flat(text: str) -> str:
    """`text` with its whitespace runs made single spaces: rich wraps long lines to the terminal."""
    return " ".join(text.split())
