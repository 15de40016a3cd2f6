"""The API app wired to the test's rolled-back transaction and a recording dispatcher."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service.app import create_app
from service.config import Settings

ADMIN_TOKEN = "test-admin-token-0123456789"


class RecordingDispatcher:
    """Stands in for the broker in API tests: records which job ids were published, in order."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.devices: list[str] = []

    def send(self, job_id: str, *, device: str) -> None:
        self.sent.append(job_id)
        self.devices.append(device)


@pytest.fixture
def dispatcher() -> RecordingDispatcher:
    return RecordingDispatcher()


@pytest.fixture
def settings(pg_url: str, tmp_path: Path) -> Settings:
    return Settings(
        database_url=pg_url,
        broker_url="memory://",
        artifact_root=tmp_path / "artifacts",
        bootstrap_token=ADMIN_TOKEN,  # type: ignore[arg-type]
    )


@pytest.fixture
def client(
    settings: Settings, sessions: sessionmaker[Session], dispatcher: RecordingDispatcher
) -> Iterator[TestClient]:
    """An authenticated client of the real app on PostgreSQL."""
    app = create_app(settings, dispatcher=dispatcher)
    app.state.session_factory = sessions
    with TestClient(app, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
        yield c


def add_user(session: Session, name: str, *, admin: bool = False) -> str:
    """Create a user in the test's transaction and return its token."""
    from service.users import service as users

    token = users.create(session, name=name, admin=admin).token
    session.commit()
    return token


def as_user(token: str) -> dict[str, str]:
    """Headers that act as another user on the same client."""
    return {"Authorization": f"Bearer {token}"}
