"""A job's environment, for real: pip installs from a local index into a cached venv the ranks use (#33).

The index (tests/env_index.py) is pypiserver on 127.0.0.1 serving dpt-alpha 1.0 and 2.0 and
dpt-beta (which needs dpt-alpha); the runner runs attempts in this process as a worker node would,
its build in the sandbox where this host has one.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.auth.tokens import ensure_bootstrap_admin
from service.config import Settings
from service.jobs import service
from service.models import LogLine
from tests.api_fixtures import ADMIN_TOKEN
from tests.env_index import ALPHA, BETA, BLOAT, MISSING, PackageIndex
from tests.workers.runs import job_row, node_fixtures, run_attempt, run_in_thread, submit_as_admin, timeline
from workers.pyenv import environments

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()
PRINT = "import dpt_alpha, sys; print('alpha', dpt_alpha.VERSION, 'from', dpt_alpha.__file__, sys.executable)"


@pytest.fixture(scope="module")
def node(settings: Settings, package_index: PackageIndex) -> Settings:
    """The node's settings with the test index as its package source."""
    return settings.model_copy(
        update={"pip_index_url": package_index.url, "env_build_timeout_seconds": 120.0}
    )


def _submit(
    sessions: sessionmaker[Session], settings: Settings, lines: list[str], code: str = PRINT, **over: Any
) -> str:
    spec: dict[str, Any] = {
        "name": "env",
        "command": ["python", "-c", code],
        "environment": {"requirements": lines},
        "max_restarts": 2,
    }
    return submit_as_admin(sessions, spec | over, settings=settings)


def _logs(sessions: sessionmaker[Session], job_id: str) -> list[LogLine]:
    with sessions() as s:
        return list(s.query(LogLine).filter_by(job_id=job_id).order_by(LogLine.id))


def _notes(sessions: sessionmaker[Session], job_id: str) -> str:
    return " ".join(reason or "" for status, reason in timeline(sessions, job_id) if status == "running")


def test_a_job_imports_its_requirements_and_the_next_one_hits_the_cache(
    node: Settings, sessions: sessionmaker, package_index: PackageIndex
) -> None:
    before = package_index.requests(BETA)
    code = "import dpt_beta; print('beta', dpt_beta.VERSION, 'alpha', dpt_beta.ALPHA_VERSION)"
    first = _submit(sessions, node, [BETA], code, resources={"processes_per_node": 2})
    assert run_attempt(job_id=first, settings=node) is JobStatus.SUCCEEDED, job_row(sessions, first).error
    lines = _logs(sessions, first)
    for rank in (0, 1):
        assert any(line.rank == rank and "beta 1.0 alpha 2.0" in line.line for line in lines), "each rank"
    setup = [line.line for line in lines if line.rank is None and line.line.startswith("[setup]")]
    assert any("dpt-beta" in line or "dpt_beta" in line for line in setup), (
        "the installer's output is in the log"
    )
    # uv installed them (its summary line), the worker's own packages excluded: dpt-beta and dpt-alpha only.
    assert any("Installed 2 packages" in line for line in setup), setup
    assert "built in" in _notes(sessions, first), timeline(sessions, first)
    state = job_row(sessions, first).environment_state
    assert state is not None and state["state"] == "ready" and state["cache_hit"] is False, state
    built = package_index.requests(BETA) - before
    assert built >= 1, "the build asked the index"
    assert len(environments.cached(node.env_cache)) == 1, "two ranks, one environment built once"

    second = _submit(sessions, node, [BETA.upper()], code)  # the same requirement, spelt differently
    assert run_attempt(job_id=second, settings=node) is JobStatus.SUCCEEDED
    assert "cache hit" in _notes(sessions, second), timeline(sessions, second)
    again = job_row(sessions, second).environment_state
    assert again is not None and again["cache_hit"] is True and again["key"] == state["key"], again
    assert package_index.requests(BETA) - before == built, "a hit asks the index nothing"


def test_two_jobs_pinning_different_versions_each_see_their_own(
    node: Settings, sessions: sessionmaker
) -> None:
    for version in ("1.0", "2.0"):
        job_id = _submit(sessions, node, [f"{ALPHA}=={version}"])
        assert run_attempt(job_id=job_id, settings=node) is JobStatus.SUCCEEDED, job_row(
            sessions, job_id
        ).error
        said = [line.line for line in _logs(sessions, job_id) if line.rank == 0]
        assert any(line.startswith(f"alpha {version} from {node.env_cache}") for line in said), said


def test_a_requirement_the_index_lacks_fails_at_once_with_the_resolvers_message(
    node: Settings, sessions: sessionmaker
) -> None:
    job_id = _submit(sessions, node, [MISSING])
    assert run_attempt(job_id=job_id, settings=node) is JobStatus.FAILED, "not retried (max_restarts=2)"
    job = job_row(sessions, job_id)
    assert job.attempt == 1 and job.error is not None
    assert job.error["type"] == "EnvironmentBuildFailed", job.error
    # uv says "dpt-missing was not found in the package registry"; pip "No matching distribution found".
    assert "dpt-missing" in job.error["message"] and "not found" in job.error["message"].lower(), job.error


def test_the_index_down_fails_the_job_within_the_build_timeout(
    node: Settings, sessions: sessionmaker, package_index: PackageIndex
) -> None:
    package_index.stop()
    try:
        quick = node.model_copy(update={"env_build_timeout_seconds": 5.0})
        job_id = _submit(sessions, node, [f"{ALPHA}<2"])
        assert run_attempt(job_id=job_id, settings=quick) is JobStatus.FAILED
    finally:
        package_index.start()
    error = job_row(sessions, job_id).error
    assert error is not None and error["type"] == "EnvironmentBuildFailed", error
    # Either the build's own timeout ended it, or the installer gave up first (uv retries a refused
    # connection 3 times in about 4 s and says so; pip prints "ERROR: ..."): both within the 5 s.
    message = error["message"]
    assert "took longer than 5 s" in message or "ERROR:" in message or "Connection refused" in message, error


def test_a_cancel_stops_a_build_at_once(
    node: Settings, sessions: sessionmaker, package_index: PackageIndex
) -> None:
    package_index.stop()  # pip then retries the index: a build that would take a while
    try:
        job_id = _submit(sessions, node, [f"{ALPHA}!=1.5"])
        thread, out = run_in_thread(node, job_id)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = job_row(sessions, job_id).environment_state
            if state is not None and state["state"] == "preparing":
                break
            time.sleep(0.05)
        with sessions.begin() as s:
            service.cancel(s, user=ensure_bootstrap_admin(s, token=ADMIN_TOKEN), job_id=job_id)
        thread.join(timeout=60)
    finally:
        package_index.start()
    assert out == [JobStatus.CANCELLED], out
    assert job_row(sessions, job_id).status == "cancelled"
    key = environments.environment_key([f"{ALPHA}!=1.5"], settings=node)
    assert all(e["key"] != key for e in environments.cached(node.env_cache)), (
        "the cancelled build left nothing"
    )


def test_a_build_over_its_size_bound_is_stopped_while_it_runs_and_leaves_nothing(
    node: Settings, sessions: sessionmaker
) -> None:
    # dpt-bloat's build writes 64 files of 1 MiB (each under any per-file limit), then hangs for
    # 600 s: only the bound on the whole folder, measured while the build runs, ends it in time.
    bounded = node.model_copy(update={"max_env_bytes": 8 << 20, "env_build_timeout_seconds": 90.0})
    job_id = _submit(sessions, node, [BLOAT])
    started = time.monotonic()
    assert run_attempt(job_id=job_id, settings=bounded) is JobStatus.FAILED, "not retried (max_restarts=2)"
    took = time.monotonic() - started
    job = job_row(sessions, job_id)
    assert job.attempt == 1 and job.error is not None
    assert job.error["type"] == "EnvironmentTooLarge", job.error
    assert "8.0 MiB" in job.error["message"] and "DPTRAIN_MAX_ENV_BYTES" in job.error["message"], job.error
    assert took < 60, f"stopped while building, not at the build's timeout: {took:.1f} s"
    setup = [line.line for line in _logs(sessions, job_id) if line.rank is None]
    assert any("DPTRAIN_MAX_ENV_BYTES" in line for line in setup), "the setup log says why the build ended"
    key = environments.environment_key([BLOAT], settings=bounded)
    assert not (bounded.env_cache / key).exists(), "nothing of the build is kept"
    assert all(e["key"] != key for e in environments.cached(bounded.env_cache))
