"""A command job whose script reports no step: it ends with its true progress, never an invented total.

One real attempt (2 ranks under the runner's torchrun) of a script that never imports the SDK, read
back as the API, the CLI's JUnit report and the dashboard read it.
"""

from __future__ import annotations

from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from dptrain_cli.junit import junit_report
from service.config import Settings
from service.models import LogLine
from tests.workers.runs import admin_api_fixture, node_fixtures, run_attempt, store_code, submit_as_admin

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()
SCRIPT_TREE = Path(__file__).resolve().parents[1] / "fixtures" / "no_sdk_script"


api = admin_api_fixture()


def test_a_script_without_the_sdk_succeeds_at_step_0_with_no_total_and_no_recipe_defaults(
    settings: Settings, sessions: sessionmaker[Session], api: TestClient, tmp_path: Path
) -> None:
    spec = {
        "name": "hello",
        "command": ["python", "train.py"],
        "code": {"sha256": store_code(settings, SCRIPT_TREE, tmp_path)},
        "resources": {"processes_per_node": 2},
    }
    job_id = submit_as_admin(sessions, spec, settings=settings)
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED
    with sessions() as s:
        said = {line.line for line in s.query(LogLine).filter_by(job_id=job_id)}
    assert {"hello from rank 0 of 2", "hello from rank 1 of 2"} <= said, said
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job["error"]
    assert job["progress"] == {"step": 0, "total_steps": None}, "no total the script never had"
    assert job["spec"]["hyperparameters"] == {}, "no recipe defaults the script never used"
    report = junit_report(job, elapsed=1.0, timed_out=False)
    assert ET.fromstring(report).findtext("testcase/system-out") == f"job {job_id} succeeded at step 0"
