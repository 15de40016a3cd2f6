"""A clean end: a rank that crashes on its way out after dptrain.finish() does not fail its job.

Real processes: the rank wrapper around a program that aborts, and two command jobs of a tiny gloo
script on 2 ranks under dptrain's torchrun and the runner, one with finish() and one without.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from rank_contract.env import RUN_DIR_ENV
from rank_contract.layout import RunFiles
from service.config import Settings
from tests.workers.runs import job_row, node_fixtures, run_attempt, submit_as_admin, timeline
from workers.command.clean_end import after_finish
from workers.engine.events import ErrorEvent, WarningEvent, parse_event

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()
ROOT = Path(__file__).resolve().parents[2]

# Both ranks talk once over gloo, then tear down (with finish(), or by hand as most scripts do);
# rank 1 then aborts, as torch's Gloo teardown now and then does at interpreter exit.
SCRIPT = """
import os, sys
import torch, torch.distributed as dist
import dptrain
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dptrain.report(1, world=t.item())
if "--finish" in sys.argv:
    dptrain.finish()
else:
    dist.barrier()
    dist.destroy_process_group()
print("rank", os.environ["RANK"], "done", flush=True)
if os.environ["RANK"] == "1":
    os.abort()
"""


@pytest.mark.parametrize(
    ("returncode", "marked", "warned"),
    [
        (-signal.SIGABRT, True, True),
        (-signal.SIGSEGV, True, True),
        (-signal.SIGABRT, False, False),  # crashed before its clean end
        (-signal.SIGTERM, True, False),  # stopped from outside: its exit decides, as always
        (-signal.SIGKILL, True, False),
        (0, True, False),
        (1, True, False),
    ],
)
def test_only_a_crash_after_finish_is_forgiven(
    tmp_path: Path, returncode: int, marked: bool, warned: bool
) -> None:
    if marked:
        RunFiles(tmp_path).finished(2).parent.mkdir()
        RunFiles(tmp_path).finished(2).touch()
    warning = after_finish(tmp_path, 2, returncode)
    assert (warning is not None) == warned
    if warning is not None:
        name = signal.Signals(-returncode).name
        assert warning.rank == 2 and f"rank 2 was killed by {name}" in warning.message


def _events(run_dir: Path, rank: int) -> list[object]:
    return [parse_event(line) for line in RunFiles(run_dir).rank_events(rank).read_text().splitlines()]


@pytest.mark.parametrize("finish", [True, False], ids=["finished", "not-finished"])
def test_the_rank_wrapper_succeeds_for_an_abort_after_finish_only(tmp_path: Path, finish: bool) -> None:
    code = f"import os, dptrain\nif {finish}: dptrain.finish()\nos.abort()"
    argv = ["--job-id", "job-x", "--run-dir", str(tmp_path), "--", "python", "-c", code]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "1", RUN_DIR_ENV: str(tmp_path)}
    rc = subprocess.run([sys.executable, "-m", "workers.command.main", *argv], cwd=ROOT, env=env, timeout=60)
    [event] = _events(tmp_path, 1)
    log = (tmp_path / "logs" / "rank1.log").read_text()
    if finish:
        assert rc.returncode == 0
        assert isinstance(event, WarningEvent) and event.rank == 1 and "SIGABRT" in event.message
        assert "rank 1 was killed by SIGABRT after dptrain.finish()" in log
    else:
        assert rc.returncode == 128 + signal.SIGABRT
        assert isinstance(event, ErrorEvent) and "SIGABRT" in event.message


def _submit(sessions: sessionmaker[Session], settings: Settings, *args: str) -> str:
    spec = {
        "name": "clean-end",
        "command": ["python", "-c", SCRIPT, *args],
        "resources": {"processes_per_node": 2},
        "max_restarts": 0,
    }
    return submit_as_admin(sessions, spec, settings=settings)


def test_a_job_whose_rank_aborts_after_finish_succeeds_with_a_warning(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    job_id = _submit(sessions, settings, "--finish")
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED, job_row(
        sessions, job_id
    ).error
    notes = [reason or "" for status, reason in timeline(sessions, job_id) if status == "running"]
    assert any("rank 1 was killed by SIGABRT" in note for note in notes), notes


def test_the_same_abort_without_finish_fails_the_job(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    job_id = _submit(sessions, settings)
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.FAILED
    error = JobError.model_validate(job_row(sessions, job_id).error)
    assert error.rank == 1 and "SIGABRT" in error.message, error
    assert not any("SIGABRT" in (reason or "") for _, reason in timeline(sessions, job_id)[:-1])
