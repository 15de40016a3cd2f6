"""The API app on the test's rolled-back transaction, a recording placement kicker, the job to submit."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import Job, JobSpec, JobStatus, Progress
from service.app import create_app
from service.config import Settings
from service.dispatch import NodeStart
from tests.conftest import job_spec

ADMIN_TOKEN = "test-admin-token-0123456789"

# The job the API tests submit, as a user writes it: two ranks, so placement has slots to find; a
# recipe extra, so the stored spec can be seen to keep it; a label to filter on. The API fills in
# the rest.
SPEC: dict[str, Any] = job_spec(
    name="mlp-smoke",
    hyperparameters={"global_batch_size": 8, "steps": 4, "hidden_size": 16},
    resources={"processes_per_node": 2},
    labels={"team": "vision"},
)


def submit(client: TestClient, **overrides: Any) -> dict[str, Any]:
    """Submit SPEC with `overrides` merged in (as job_spec merges them); asserts 201, returns the job."""
    r = client.post("/v1/jobs", json=job_spec(SPEC, **overrides))
    assert r.status_code == 201, r.text
    return dict(r.json())


class RecordingDispatcher:
    """Stands in for the broker: records the node starts placement sent, in order."""

    def __init__(self) -> None:
        self.starts: list[NodeStart] = []

    def start_node(self, start: NodeStart) -> None:
        self.starts.append(start)

    @property
    def sent(self) -> list[str]:
        """The job ids of node 0 starts: one per placed attempt."""
        return [s.job_id for s in self.starts if s.node_rank == 0]


class RecordingScheduler:
    """Stands in for the API's placement thread: counts the kicks."""

    def __init__(self) -> None:
        self.kicks = 0

    def kick(self) -> None:
        self.kicks += 1


@pytest.fixture
def scheduler() -> RecordingScheduler:
    return RecordingScheduler()


@pytest.fixture
def settings(pg_url: str, tmp_path: Path) -> Settings:
    return Settings(
        database_url=pg_url,
        broker_url="memory://",
        artifact_root=tmp_path / "artifacts",
        bootstrap_token=ADMIN_TOKEN,  # type: ignore[arg-type]
        # A test's changes are never committed (rolled back after it), so PostgreSQL never notifies
        # them and the job cache would keep what a test changed: tests/jobs/test_poll_cache.py
        # covers the cache on a database whose changes commit.
        poll_cache=False,
    )


@pytest.fixture
def sqlite_settings() -> dict[str, Any]:
    """What the module's SQLite app sets beyond `sqlite_client`'s settings; a module overrides this."""
    return {}


@pytest.fixture
def sqlite_client(tmp_path: Path, sqlite_settings: dict[str, Any]) -> Iterator[TestClient]:
    """An authenticated client of the real app on SQLite, the embedded service's database."""
    from tests.backends import sqlite_app  # it imports this module

    with sqlite_app(tmp_path, **sqlite_settings) as c:
        yield c


@pytest.fixture
def client(
    settings: Settings, sessions: sessionmaker[Session], scheduler: RecordingScheduler
) -> Iterator[TestClient]:
    """An authenticated client of the real app on PostgreSQL."""
    app = create_app(settings, scheduler=scheduler)
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


def register_node(
    sessions: sessionmaker[Session], *, name: str, slots: int, device: str = "cpu", address: str = "127.0.0.1"
) -> None:
    """A worker node's heartbeat, as `dptrain worker` writes it, beating now."""
    from service.models.base import utcnow
    from service.nodes import repository

    with sessions.begin() as session:
        repository.heartbeat(
            session,
            name=name,
            hostname="test-host",
            address=address,
            device=device,
            device_count=slots,
            slots=slots,
            now=utcnow(),
        )


def queued_job_json(
    job_id: str, spec: dict[str, Any] | None = None, *, owner: str = "admin"
) -> dict[str, Any]:
    """A queued job of `spec` (default: the smallest job) as the API answers it, for a client under test."""
    now = datetime.now(UTC)
    spec = spec if spec is not None else job_spec()
    job = Job(
        id=job_id,
        name=spec["name"],
        status=JobStatus.QUEUED,
        spec=JobSpec.model_validate(spec),
        owner=owner,
        created_at=now,
        updated_at=now,
        started_at=None,
        finished_at=None,
        progress=Progress(step=0, total_steps=4),
        attempt=0,
        error=None,
    )
    return job.model_dump(mode="json")
