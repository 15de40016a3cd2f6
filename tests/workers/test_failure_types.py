"""A command job fails with the type its program raised, on the rank that raised it: the type decides.

Real torchrun, 2 ranks, tiny scripts (gloo, no training) run as command jobs by the runner with
`max_restarts: 1`: a job that is not retried fails after its first attempt; one that is, is queued
again. See workers/command/failure.py (how the type is found) and workers/attempt/end.is_retryable.
"""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from rank_contract.layout import JobFiles, RunFiles
from service.config import Settings
from tests.workers.runs import job_row, node_fixtures, run_attempt, store_code, submit_as_admin
from workers.attempt.node_run import RunPaths

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()

# One program, failing as its argument says; torch only where the process group must be up.
FAIL = """\
import os
import signal
import sys
import time

mode, rank = sys.argv[1], int(os.environ["RANK"])
if mode == "exit":
    print("giving up quietly", flush=True)
    sys.exit(3)
if mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)

import torch.distributed as dist

dist.init_process_group("gloo")  # from here on, torch prefixes every traceback line with [rankN]:
if mode == "assert":
    n_embd, n_head = 64, 3
    assert n_embd % n_head == 0
if mode == "rank1":
    if rank == 1:
        raise KeyError("shard-7")
    time.sleep(60)  # until torchrun stops this rank, its peer having failed
"""
# The main file does not compile: Python prints no Traceback header for it.
SYNTAX = "import os\n\ndef main()\n    print(os.getpid())\n"
IMPORTS = "from math import no_such_function\n"


@pytest.fixture(scope="module")
def code_sha(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The scripts' tree, packed and stored as an upload would have."""
    tree = tmp_path_factory.mktemp("scripts")
    for name, text in {"fail.py": FAIL, "syntax.py": SYNTAX, "imports.py": IMPORTS}.items():
        (tree / name).write_text(text)
    return store_code(settings, tree, tmp_path_factory.mktemp("pack"))


def _run(
    sessions: sessionmaker[Session], settings: Settings, code_sha: str, *command: str
) -> tuple[JobStatus | None, str]:
    spec = {
        "name": "fails",
        "command": ["python", *command],
        "code": {"sha256": code_sha},
        "resources": {"processes_per_node": 2},
        "max_restarts": 1,
    }
    job_id = submit_as_admin(sessions, spec, settings=settings)
    return run_attempt(job_id=job_id, settings=settings), job_id


@pytest.mark.parametrize(
    ("command", "error_type", "rank", "message"),
    [
        # After init_process_group; the message names the bare assert's line.
        (["fail.py", "assert"], "AssertionError", None, "assert n_embd % n_head == 0 (fail.py, line 18)"),
        (["syntax.py"], "SyntaxError", None, "expected ':' (syntax.py, line 3)"),
        (["imports.py"], "ImportError", None, "cannot import name 'no_such_function' from 'math'"),
        (["fail.py", "rank1"], "KeyError", 1, "'shard-7'"),
    ],
    ids=["assert-after-init", "syntax-error", "import-error", "rank-1-only"],
)
def test_a_bug_fails_the_job_at_once_with_its_type_and_rank(
    settings: Settings,
    sessions: sessionmaker,
    code_sha: str,
    command: list[str],
    error_type: str,
    rank: int | None,
    message: str,
) -> None:
    status, job_id = _run(sessions, settings, code_sha, *command)
    job = job_row(sessions, job_id)
    error = JobError.model_validate(job.error)
    assert (status, job.attempt) == (JobStatus.FAILED, 1), f"not retried: {error}"
    assert error.type == error_type and message in error.message, error
    if rank is not None:
        assert error.rank == rank, f"the rank that raised, not its peer stopped after it: {error}"
    assert error.rank in (0, 1) and error.traceback, error
    assert error.traceback.splitlines()[-1].startswith(error_type), error.traceback
    if error_type == "AssertionError":
        # Recorded by dptrain's start-up hook, inside the sandbox, for each rank's program.
        run_dir = RunPaths(JobFiles(settings.artifacts, job_id), 1).run.folder
        assert all(RunFiles(run_dir).exception(r).is_file() for r in (0, 1)), sorted(run_dir.rglob("*"))


@pytest.mark.parametrize(
    ("command", "error_type", "message"),
    [
        (["fail.py", "exit"], "ProcessExited", "exited with code 3"),
        (["fail.py", "killed"], "ProcessKilled", "was killed by SIGKILL"),
    ],
    ids=["exit-3", "killed"],
)
def test_an_exit_or_a_signal_without_a_traceback_is_retried(
    settings: Settings,
    sessions: sessionmaker,
    code_sha: str,
    command: list[str],
    error_type: str,
    message: str,
) -> None:
    status, job_id = _run(sessions, settings, code_sha, *command)
    job = job_row(sessions, job_id)
    error = JobError.model_validate(job.error)
    assert status is JobStatus.QUEUED and job.status == "queued", f"restarted: {error}"
    assert error.type == error_type and message in error.message, error
    assert error.rank in (0, 1) and f"rank {error.rank} " in error.message, error
    # The one restart `max_restarts: 1` allows ends the same way, and the job fails.
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.FAILED
    job = job_row(sessions, job_id)
    assert job.attempt == 2 and JobError.model_validate(job.error).type == error_type, job.error
