"""A loader that raises fails the job within 60 s with its type: a real job through the node runner.

An entrypoint job, uploaded as code, on 2 ranks with `data.num_workers: 2`, whose samples cannot leave
the loader process (pickling them raises the plan's own `SampleNotPortable`). Before, the loader
process printed that and dropped the batch, and the ranks waited until the stall timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from service.config import Settings
from tests.workers.runs import job_row, node_fixtures, run_in_thread, store_code, submit_as_admin
from workers.sandbox.procs import rank_processes

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()
PLAN_TREE = Path(__file__).resolve().parents[1] / "fixtures" / "loader_plan"


@pytest.fixture(scope="module")
def code_sha(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The plan's tree, packed and stored where `PUT /v1/code/{sha256}` would have put it."""
    return store_code(settings, PLAN_TREE, tmp_path_factory.mktemp("pack"))


def test_a_loader_that_raises_fails_the_job_within_60_s_with_its_type(
    settings: Settings, sessions: sessionmaker[Session], code_sha: str
) -> None:
    job_id = submit_as_admin(
        sessions,
        {
            "name": "loader-raises",
            "entrypoint": "loader_faults:build",
            "code": {"sha256": code_sha},
            "hyperparameters": {"global_batch_size": 8, "steps": 4, "loader_fault": "unportable"},
            "resources": {"processes_per_node": 2},
            "data": {"num_workers": 2},
        },
        settings=settings,
    )
    start = time.monotonic()
    thread, out = run_in_thread(settings, job_id)
    thread.join(timeout=120)
    took = time.monotonic() - start
    assert not thread.is_alive(), "the attempt must end, not wait for a batch that never comes"
    assert out == [JobStatus.FAILED], out
    assert took < 60, f"expected the job to fail within 60 s, it took {took:.0f} s"
    error = JobError.model_validate(job_row(sessions, job_id).error)
    assert error.type == "SampleNotPortable", error
    assert "a sample's handle cannot leave process" in error.message, error
    assert "loader process" in error.message and error.rank is not None, error
    assert rank_processes(job_id) == [], "no rank or loader process may be left behind"
