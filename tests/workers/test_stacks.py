"""Every rank's stack: on demand while a command job hangs, and in the record of the stall that ends it.

One real two-rank command job (torchrun, gloo, sandboxed as the runner does): rank 0 blocks in an
all_reduce that rank 1 skips (it waits in a sleep loop). While it hangs, `GET /v1/jobs/{id}/stacks`
asks its worker for a dump; then the stall watchdog ends it with both stacks in its log, its
timeline and its error message.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStacks, JobStatus
from service.config import Settings
from service.models import LogLine, RankStacks
from tests.workers.runs import (
    admin_api_fixture,
    job_row,
    node_fixtures,
    run_attempt,
    run_in_thread,
    store_code,
    submit_as_admin,
    timeline,
)
from workers.sandbox.procs import rank_processes

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()

SCRIPT = """\
import datetime
import sys
import time

import torch
import torch.distributed as dist


def wait_for_peer():
    while True:
        time.sleep(0.2)  # WAIT


dist.init_process_group("gloo")
# --timeout: a group whose collectives time out after 3 s (the default group waits 30 minutes).
group = dist.new_group(timeout=datetime.timedelta(seconds=3)) if "--timeout" in sys.argv else None
rank = dist.get_rank()
print(f"rank {rank} ready", flush=True)
if rank == 0:
    dist.all_reduce(torch.ones(1), group=group)  # ALL_REDUCE: rank 1 never joins it
else:
    wait_for_peer()
"""


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(SCRIPT.splitlines(), 1) if marker in text)


api = admin_api_fixture()


def _logs(sessions: sessionmaker[Session], job_id: str) -> list[LogLine]:
    with sessions() as s:
        return list(s.query(LogLine).filter_by(job_id=job_id).order_by(LogLine.id))


def _wait_ready(sessions: sessionmaker[Session], job_id: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = {line.line for line in _logs(sessions, job_id)}
        if {"rank 0 ready", "rank 1 ready"} <= lines:
            return
        time.sleep(0.2)
    raise AssertionError(f"the ranks of job {job_id} did not both start in {timeout} s")


@pytest.fixture(scope="module")
def code_sha(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The script's tree, stored where `PUT /v1/code/{sha256}` would have put it."""
    tree = tmp_path_factory.mktemp("tree")
    (tree / "train.py").write_text(SCRIPT)
    return store_code(settings, tree, tmp_path_factory.mktemp("pack"))


def _spec(settings: Settings, code_sha: str, *args: str, **over: Any) -> dict[str, Any]:
    spec = {
        "name": "hang",
        "command": ["python", "train.py", *args],
        "code": {"sha256": code_sha},
        "resources": {"processes_per_node": 2},
    }
    return spec | over


@pytest.fixture(scope="module")
def hung(
    settings: Settings,
    sessions: sessionmaker[Session],
    api: TestClient,
    code_sha: str,
) -> tuple[str, JobStacks, JobStatus]:
    """A hung job: its stacks asked for while it hangs, then its end (the stall watchdog's)."""
    # Long enough for the request below to be answered before the watchdog ends the hang.
    job_id = submit_as_admin(sessions, _spec(settings, code_sha, stall_timeout_seconds=20), settings=settings)
    thread, out = run_in_thread(settings, job_id)
    try:
        _wait_ready(sessions, job_id)
        r = api.get(f"/v1/jobs/{job_id}/stacks", params={"wait": 15})
        assert r.status_code == 200, r.text
        on_demand = JobStacks.model_validate(r.json())
    finally:
        thread.join(timeout=180)
    assert out, "the attempt ended"
    return job_id, on_demand, out[0]


def test_on_demand_stacks_show_every_thread_of_every_rank(hung: tuple[str, JobStacks, JobStatus]) -> None:
    job_id, stacks, _ = hung
    assert stacks.fresh and len(stacks.dumps) == 1, stacks
    dump = stacks.dumps[0]
    assert dump.reason == "request" and dump.note is None, dump
    by_rank = {p.rank: p for p in dump.processes}
    assert set(by_rank) == {0, 1}, [(p.rank, p.command) for p in dump.processes]
    for p in by_rank.values():
        assert p.error is None and p.threads and all(t.frames for t in p.threads), p
    assert by_rank[0].where == f"all_reduce (train.py:{_line('ALL_REDUCE')})"
    assert by_rank[1].where == f"wait_for_peer (train.py:{_line('WAIT')})"


def test_a_stalled_collective_ends_with_every_ranks_stack_in_its_error_log_and_timeline(
    settings: Settings, sessions: sessionmaker[Session], hung: tuple[str, JobStacks, JobStatus]
) -> None:
    job_id, _, status = hung
    assert status is JobStatus.FAILED
    error = JobError.model_validate(job_row(sessions, job_id).error)
    where = (
        f"rank 0 in all_reduce (train.py:{_line('ALL_REDUCE')}); "
        f"rank 1 in wait_for_peer (train.py:{_line('WAIT')})"
    )
    assert error.type == "Stalled" and error.message.endswith(where), error
    lines = [(line.rank, line.line) for line in _logs(sessions, job_id)]
    for rank in (0, 1):
        assert any(
            r == rank and text.startswith(f"dptrain: stacks (stall) of rank {rank}") for r, text in lines
        )
    assert any("all_reduce (" in text and "distributed_c10d.py" in text for _, text in lines), lines
    reasons = " | ".join(reason or "" for _, reason in timeline(sessions, job_id))
    assert f"stacks at the stall ({settings.node}): {where}" in reasons, reasons
    # Read from outside the sandbox's PID namespace, as the runner runs every job.
    assert "not sandboxed" not in reasons
    with sessions() as s:
        dumps = sorted(r.reason for r in s.query(RankStacks).filter_by(job_id=job_id))
    assert dumps == ["request", "stall"]
    assert rank_processes(job_id) == []


def test_stacks_of_a_job_that_is_not_running_are_a_409_and_of_an_unknown_one_a_404(
    api: TestClient, hung: tuple[str, JobStacks, JobStatus]
) -> None:
    job_id, _, _ = hung
    r = api.get(f"/v1/jobs/{job_id}/stacks")
    assert r.status_code == 409 and "only while it runs" in r.json()["detail"], r.text
    assert api.get("/v1/jobs/no-such-job/stacks").status_code == 404


def test_a_collective_timeout_names_where_the_rank_still_alive_was(
    settings: Settings, sessions: sessionmaker[Session], code_sha: str
) -> None:
    job_id = submit_as_admin(sessions, _spec(settings, code_sha, "--timeout"), settings=settings)
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.FAILED
    error = JobError.model_validate(job_row(sessions, job_id).error)
    # Rank 0's own error, then where rank 1 was when the worker saw it: rank 0 waited for that dump
    # before exiting, so torchrun had not torn rank 1 down yet.
    assert error.rank == 0 and "Timed out" in error.message, error
    assert error.message.endswith(f"; rank 1 in wait_for_peer (train.py:{_line('WAIT')})"), error
    lines = [(line.rank, line.line) for line in _logs(sessions, job_id)]
    assert any(
        r == 1 and text.startswith("dptrain: stacks (collective timeout) of rank 1") for r, text in lines
    )
    assert rank_processes(job_id) == []
