"""A command job that prints past DPTRAIN_MAX_LOG_BYTES_PER_JOB: its stored log stops at the cap, says so, and
the job still succeeds (a real rank under the runner, on PostgreSQL)."""

from __future__ import annotations

import re

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.config import Settings
from service.models import LogLine
from tests.workers.runs import job_row, node_fixtures, run_attempt, submit_as_admin
from workers.reporting.log_budget import line_bytes

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()
CAP = 8192
LINES = 2000
PROGRAM = f"for i in range({LINES}): print(f'line {{i:05d}} ' + 'x' * 40)\nprint('z' * 100_000)"


def test_a_job_printing_past_the_cap_keeps_the_cap_and_a_marker_and_succeeds(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    # The runner hands its own settings' cap to the reporter: a worker with a cap of CAP bytes.
    settings = settings.model_copy(update={"max_log_bytes_per_job": CAP})
    spec = {"name": "chatty", "command": ["python", "-c", PROGRAM], "resources": {"processes_per_node": 1}}
    job_id = submit_as_admin(sessions, spec, settings=settings)
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED
    assert job_row(sessions, job_id).status == "succeeded"
    with sessions() as s:
        lines = list(s.query(LogLine).filter_by(job_id=job_id).order_by(LogLine.id))
    markers = [ln.line for ln in lines if ln.line.startswith("[dptrain] ")]
    kept = [ln.line for ln in lines if not ln.line.startswith("[dptrain] ")]
    assert sum(line_bytes(x) for x in kept) <= CAP, "the stored lines stay under the cap"
    assert len(markers) == 2 and "reached DPTRAIN_MAX_LOG_BYTES_PER_JOB (8192 bytes)" in markers[0], markers
    counted = re.search(r"dropped (\d+) log lines \((\d+) bytes\)", markers[1])
    assert counted is not None, markers
    printed = sum(1 for x in kept if x.startswith("line "))
    assert int(counted.group(1)) >= LINES + 1 - printed, (counted.group(0), printed)
    each = line_bytes("line 00000 " + "x" * 40)
    assert int(counted.group(2)) >= (LINES - printed) * each, (counted.group(0), printed)
    assert markers[1].startswith("[dptrain] attempt 1 dropped"), markers
