"""DPTRAIN_RUN_AS: ranks run as an unprivileged user and cannot read another job's checkpoints.

The worker must be root to switch users (CI and this project's machines run the tests as root);
the test creates the user, as an operator would once per host.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from service.config import Settings
from service.models import JobArtifact, LogLine
from tests.workers.runs import job_row, node_settings, run_attempt, submit_as_admin

pytestmark = pytest.mark.e2e

RUN_AS = "dptrain-run"


@pytest.fixture(scope="module")
def run_as_user() -> str:
    """An unprivileged user who can run the worker's interpreter (the user an operator would create)."""
    assert os.getuid() == 0, "DPTRAIN_RUN_AS needs a root worker: run the tests as root, as CI does"
    try:
        pwd.getpwnam(RUN_AS)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", RUN_AS], check=True
        )
    # The interpreter may live under a private home (pyenv under /root): let others pass through
    # (not list) its folders, as a host that runs jobs as another user must.
    for folder in Path(os.path.realpath(sys.executable)).parents:
        mode = folder.stat().st_mode
        if not mode & 0o001:
            os.chmod(folder, mode | 0o001)
    return RUN_AS


@pytest.fixture(scope="module")
def settings(own_database: str, tmp_path_factory: pytest.TempPathFactory, run_as_user: str) -> Settings:
    home = tmp_path_factory.mktemp("run-as")
    os.chmod(home, 0o711)
    for folder in home.parents:  # pytest's temporary root is private to root
        os.chmod(folder, folder.stat().st_mode | 0o001)
    return node_settings(own_database, home).model_copy(update={"run_as": run_as_user})


@pytest.fixture(scope="module")
def sessions(settings: Settings) -> sessionmaker[Session]:
    from service.db import session_factory

    return session_factory(settings)


def _python(sessions: sessionmaker[Session], settings: Settings, code: str) -> str:
    return submit_as_admin(
        sessions,
        {"name": "run-as", "command": ["python", "-c", code], "hyperparameters": {"steps": 1}},
        settings=settings,
    )


# In the sandbox another job's folder is not there at all; without it, the folders' modes refuse it.
@pytest.mark.parametrize(("sandbox", "refused"), [("auto", "FileNotFoundError"), ("off", "PermissionError")])
def test_ranks_run_as_the_user_and_cannot_read_another_jobs_checkpoints(
    settings: Settings, sessions: sessionmaker[Session], run_as_user: str, sandbox: str, refused: str
) -> None:
    settings = settings.model_copy(update={"sandbox": sandbox})
    # Job A writes a "checkpoint" into its checkpoint directory, as its ranks' user.
    writer = _python(
        sessions,
        settings,
        "import os; d = os.environ['DPTRAIN_CHECKPOINT_DIR']; "
        "open(os.path.join(d, 'secret.txt'), 'w').write('weights'); print('uid', os.getuid()); "
        "open(os.path.join(os.environ['DPTRAIN_OUTPUT_DIR'], 'model.bin'), 'w').write('kept')",
    )
    assert run_attempt(job_id=writer, settings=settings) is JobStatus.SUCCEEDED
    # Its outputs are recorded, and the worker's again once the attempt ended, like its checkpoints.
    output = settings.artifacts / "jobs" / writer / "outputs" / "model.bin"
    assert output.stat().st_uid == os.getuid() and output.read_text() == "kept"
    with sessions() as s:
        assert [a.path for a in s.query(JobArtifact).filter_by(job_id=writer)] == ["model.bin"]
    with sessions() as s:
        lines = [r.line for r in s.query(LogLine).filter_by(job_id=writer)]
    assert f"uid {pwd.getpwnam(run_as_user).pw_uid}" in lines, lines
    secret_dir = settings.artifacts / "jobs" / writer / "checkpoints"
    assert (secret_dir / "secret.txt").read_text() == "weights"
    # Job B, the same user later, tries to read it.
    reader = _python(sessions, settings, f"print(open({str(secret_dir / 'secret.txt')!r}).read())")
    assert run_attempt(job_id=reader, settings=settings) is JobStatus.FAILED
    error = JobError.model_validate(job_row(sessions, reader).error)
    assert error.type == refused, error
    lister = _python(sessions, settings, f"import os; print(os.listdir({str(secret_dir)!r}))")
    assert run_attempt(job_id=lister, settings=settings) is JobStatus.FAILED
    assert JobError.model_validate(job_row(sessions, lister).error).type == refused
