"""A rank that fails mid-job fails the whole job, reports itself, and leaves no process behind."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.engine_fixtures import processes_mentioning

pytestmark = pytest.mark.e2e  # torchrun, and a look at what it left running


def test_injected_fault_fails_job_and_cleans_up(engine_runner: Any, make_spec: Any) -> None:
    spec = make_spec(hyperparameters={"steps": 6})
    run = engine_runner(spec, 2, extra_env={"DPTRAIN_FAULT_INJECT": "raise:rank=1:step=2"})
    assert run.returncode != 0, f"expected torchrun to exit non-zero\n{run.describe()}"

    errors = [e for e in run.events(1) if e["type"] == "error"]
    assert len(errors) == 1, f"expected one error event from rank 1, got {run.events(1)}\n{run.describe()}"
    err = errors[0]
    assert err["rank"] == 1 and err["error_type"] == "RuntimeError", f"unexpected error event {err}"
    assert err["message"] == "injected fault at step 2", f"unexpected message {err['message']!r}"
    assert "injected fault" in err["traceback"], f"expected the traceback tail, got {err['traceback']!r}"
    assert "injected fault" in run.log(1), f"expected rank 1's log to hold the traceback, got {run.log(1)!r}"
    assert not any(e["type"] == "finished" for e in run.events(0)), "a failed job must not report finished"

    # torchrun tears the surviving rank down before it returns; allow a moment for reaping.
    deadline = time.monotonic() + 10
    while (left := processes_mentioning(run.job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"expected no process of job {run.job_id} to remain, found {left}"
