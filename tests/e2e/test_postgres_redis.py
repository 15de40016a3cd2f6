"""End to end on the production components: API + Celery worker over Redis, PostgreSQL, real ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from api_schemas import JobSpec
from service.auth.tokens import ensure_bootstrap_admin
from service.config import Settings
from service.db import session_factory
from service.jobs import submit
from tests.api_fixtures import ADMIN_TOKEN
from tests.e2e.helpers import clean_env, wait_for_terminal
from tests.e2e.scenario import SPEC, run_mlp_scenario
from tests.e2e.stack import Stack

pytestmark = pytest.mark.e2e


def test_mlp_on_two_ranks_through_redis_and_postgres(stack: Stack) -> None:
    http, procs = stack.http, stack.procs
    run_mlp_scenario(http, procs)


def test_a_job_committed_but_never_published_still_runs(stack: Stack) -> None:
    """A crash between commit and publish: the row exists, no message does; the reconciler recovers it."""
    http, procs, db_url = stack.http, stack.procs, stack.db_url
    spec = JobSpec.model_validate({**SPEC, "name": "never-published"})
    settings = Settings(database_url=db_url)
    with session_factory(settings).begin() as session:
        admin = ensure_bootstrap_admin(session, token=ADMIN_TOKEN)
        job_id = submit.submit(session, user=admin, spec=spec, settings=settings)[0].id  # not published
    job = wait_for_terminal(http, job_id, procs=procs)
    assert job["status"] == "succeeded" and job["attempt"] == 1, job


def test_cli_submit_wait_exit_codes(stack: Stack, tmp_path: Path) -> None:
    """CI pipelines rely on the exit code: 0 succeeded, 1 failed, 2 timeout, 3 refused."""
    http, procs = stack.http, stack.procs
    env = clean_env(DPTRAIN_API_URL=str(http.base_url), DPTRAIN_TOKEN=ADMIN_TOKEN)

    def submit(spec: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
        path = tmp_path / f"{spec['name']}.yaml"
        path.write_text(yaml.safe_dump(spec))
        cmd = [sys.executable, "-m", "dptrain_cli.main", "submit", str(path), *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)

    ok = submit({**SPEC, "name": "cli-ok"}, "--wait", "--timeout", "200")
    assert ok.returncode == 0, (
        f"expected exit 0 for a succeeded job:\n{ok.stdout}\n{ok.stderr}\n{procs.logs()}"
    )
    assert "succeeded" in ok.stdout

    slow = {**SPEC, "name": "cli-slow", "hyperparameters": {**SPEC["hyperparameters"], "steps": 10_000_000}}
    timed_out = submit(slow, "--wait", "--timeout", "1")
    assert timed_out.returncode == 2, timed_out.stderr
    job_id = timed_out.stdout.strip().splitlines()[0]
    assert http.post(f"/v1/jobs/{job_id}/cancel").status_code == 200

    failing = {**slow, "name": "cli-fail", "max_runtime_seconds": 2}
    failed = submit(failing, "--wait", "--timeout", "200")
    assert failed.returncode == 1, f"expected exit 1 for a failed job:\n{failed.stdout}\n{failed.stderr}"
    assert "deadline exceeded" in failed.stderr

    refused = submit({**SPEC, "name": "cli-bad", "recipe": "nope"}, "--wait")
    assert refused.returncode == 3 and "unknown recipe" in refused.stderr, refused.stderr
    assert wait_for_terminal(http, job_id, procs=procs)["status"] == "cancelled"
