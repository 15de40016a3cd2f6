"""Run one attempt of a job in the test's process, as its node's worker would after placement."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobSpec, JobStatus
from dptrain.workdir import pack
from rank_contract.layout import code_archive
from service.app import create_app
from service.auth.tokens import ensure_bootstrap_admin
from service.code import repository as code_repository
from service.config import Settings
from service.db import session_factory
from service.jobs import lifecycle, submit
from service.models import Job, JobTransition
from service.models.base import utcnow
from service.scheduling import repository
from tests.api_fixtures import ADMIN_TOKEN, RecordingScheduler
from workers.attempt.runner import run_node


def node_settings(database_url: str, home: Path) -> Settings:
    """The settings of this test's process as a worker node: artifacts under `home`, quick reports."""
    return Settings(
        database_url=database_url, artifact_root=home / "artifacts", home=home, report_interval_seconds=0.2
    )


def node_fixtures() -> tuple[Any, Any]:
    """Module-scoped `settings` and `sessions` fixtures of a node whose database is the module's own.

    The runner commits through sessions of its own, so it cannot share the rolled-back transaction of
    the other tests; a module assigns both (`settings, sessions = node_fixtures()`).
    """

    @pytest.fixture(scope="module", name="settings")
    def settings(own_database: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
        return node_settings(own_database, tmp_path_factory.mktemp("node"))

    @pytest.fixture(scope="module", name="sessions")
    def sessions(settings: Settings) -> sessionmaker[Session]:
        return session_factory(settings)

    return settings, sessions


def admin_api_fixture() -> Any:
    """A module-scoped `api`: the API on the node's database, as the admin (`api = admin_api_fixture()`)."""

    @pytest.fixture(scope="module", name="api")
    def api(settings: Settings) -> Iterator[TestClient]:
        admin = settings.model_copy(update={"bootstrap_token": SecretStr(ADMIN_TOKEN)})
        app = create_app(admin, scheduler=RecordingScheduler())
        with TestClient(app, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as client:
            yield client

    return api


def store_code(settings: Settings, tree: Path, work: Path) -> str:
    """Pack `tree` and store it as `PUT /v1/code/{sha256}` would have, uploaded by the admin; its sha256."""
    packed = pack(tree, work / "code.tar.gz")
    dest = code_archive(settings.artifacts, packed.sha256)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(packed.path, dest)
    # The archive's row too: the submit gate lets a spec name only an archive that was uploaded.
    with session_factory(settings).begin() as s:
        admin = ensure_bootstrap_admin(s, token=ADMIN_TOKEN)
        size = dest.stat().st_size
        code_repository.record(s, sha256=packed.sha256, size_bytes=size, user_id=admin.id, now=utcnow())
    return packed.sha256


def submit_as_admin(sessions: sessionmaker[Session], spec: dict[str, Any], *, settings: Settings) -> str:
    """Submit `spec` as the bootstrap admin through the submit gate (no API); returns the job id.

    `settings` are the API's, which on these one-host tests are the node's own (its artifact root
    holds the code archives and the pins of an `init_from`).
    """
    with sessions.begin() as s:
        user = ensure_bootstrap_admin(s, token=ADMIN_TOKEN)
        job, _ = submit.submit(s, user=user, spec=JobSpec.model_validate(spec), settings=settings)
        return job.id


def place_here(settings: Settings, *, job_id: str) -> int:
    """Start a new attempt of a queued job on this test's node (settings.node); returns the attempt.

    Placement's rules are tested in tests/scheduling; runner tests only need the rows it writes.
    """
    with session_factory(settings).begin() as s:
        job = lifecycle.claim(s, job_id=job_id, worker=settings.node)
        assert job is not None, f"job {job_id} is not queued"
        row = {
            "job_id": job_id,
            "node_rank": 0,
            "attempt": job.attempt,
            "worker": settings.node,
            "slots": int(job.spec["resources"]["processes_per_node"]),
            "address": "127.0.0.1",
            "port": None,
            "placed_at": utcnow(),
            "started_at": None,
        }
        repository.add_nodes(s, rows=[row])
        return job.attempt


def run_attempt(*, job_id: str, settings: Settings) -> JobStatus | None:
    """Place a queued job here and run it to its end; a job already placed is delivered again (None)."""
    with session_factory(settings)() as s:
        job = s.get(Job, job_id)
        assert job is not None
        status, attempt = job.status, job.attempt
    if status == JobStatus.QUEUED.value:
        attempt = place_here(settings, job_id=job_id)
    return run_node(job_id=job_id, attempt=attempt, node_rank=0, settings=settings)


def job_row(sessions: sessionmaker[Session], job_id: str) -> Job:
    """The job's row as it is now."""
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None, f"job {job_id} is gone"
        return job


def timeline(sessions: sessionmaker[Session], job_id: str) -> list[tuple[str, str | None]]:
    """The job's transitions as (to_status, reason), oldest first."""
    with sessions() as s:
        rows = s.query(JobTransition).filter_by(job_id=job_id).order_by(JobTransition.id).all()
        return [(r.to_status, r.reason) for r in rows]


def statuses(sessions: sessionmaker[Session], job_id: str) -> list[str]:
    """The statuses the job went through, oldest first."""
    return [status for status, _ in timeline(sessions, job_id)]


def run_in_thread(settings: Settings, job_id: str) -> tuple[threading.Thread, list[Any]]:
    """`run_attempt` in a thread; its result is appended to the returned list when it ends."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(run_attempt(job_id=job_id, settings=settings)))
    t.start()
    return t, out


def wait_step(sessions: sessionmaker[Session], job_id: str, step: int, timeout: float = 90) -> None:
    """Wait until the job has reported `step`; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job_row(sessions, job_id).step >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not reach step {step} in {timeout} s")
