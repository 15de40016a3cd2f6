"""Command jobs: the user's own DDP script, unmodified, from an uploaded tree, on 2 ranks under the runner.

The script (tests/fixtures/ddp_script/train.py) uses torch and the `dptrain` SDK only; these tests
run attempts in this process as a worker node would, on real rank processes and PostgreSQL.
"""

from __future__ import annotations

import hashlib
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from service.auth.tokens import ensure_bootstrap_admin
from service.config import Settings
from service.jobs import repository, service
from service.models import LogLine, Metric
from tests.api_fixtures import ADMIN_TOKEN
from tests.workers.runs import (
    admin_api_fixture,
    job_row,
    node_fixtures,
    run_attempt,
    run_in_thread,
    store_code,
    submit_as_admin,
    wait_step,
)
from workers.sandbox.procs import rank_processes

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()
SCRIPT_TREE = Path(__file__).resolve().parents[1] / "fixtures" / "ddp_script"


@pytest.fixture(scope="module")
def code_sha(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The script's tree, packed and stored where `PUT /v1/code/{sha256}` would have put it."""
    return store_code(settings, SCRIPT_TREE, tmp_path_factory.mktemp("pack"))


api = admin_api_fixture()


def _submit(
    sessions: sessionmaker[Session], settings: Settings, code_sha: str, *args: str, **over: Any
) -> str:
    spec: dict[str, Any] = {
        "name": "script",
        "command": ["python", "train.py", *args],
        "code": {"sha256": code_sha},
        "resources": {"processes_per_node": 2},
        "hyperparameters": {"steps": 6},
        "checkpoint": {"keep_last": 2},
    }
    spec.update(over)
    return submit_as_admin(sessions, spec, settings=settings)


def _logs(sessions: sessionmaker[Session], job_id: str) -> list[LogLine]:
    with sessions() as s:
        return list(s.query(LogLine).filter_by(job_id=job_id).order_by(LogLine.id))


def _logs_text(sessions: sessionmaker[Session], job_id: str) -> str:
    return "\n".join(line.line for line in _logs(sessions, job_id))


def _wait_gone(job_id: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while rank_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank_processes(job_id) == [], f"rank processes still alive {seconds} s later"


def test_a_ddp_script_reports_metrics_checkpoints_and_per_rank_logs(
    settings: Settings, sessions: sessionmaker, code_sha: str, api: TestClient
) -> None:
    job_id = _submit(sessions, settings, code_sha, "--steps", "6")
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED
    job = job_row(sessions, job_id)
    assert job.status == "succeeded" and job.step == 6, (job.status, job.step, job.error)
    with sessions() as s:
        losses = s.query(Metric).filter_by(job_id=job_id, name="loss").count()
        checkpoints = repository.checkpoints(s, job_id=job_id)
    assert losses == 6, "one loss point per reported step"
    assert [c.step for c in checkpoints] == [4, 6], "keep_last=2 of the SDK's checkpoints every 2 steps"
    for ckpt in checkpoints:
        r = api.get(f"/v1/jobs/{job_id}/checkpoints/{ckpt.id}/download")
        assert r.status_code == 200
        assert hashlib.sha256(r.content).hexdigest() == ckpt.sha256 == r.headers["X-Checkpoint-SHA256"]
    ranks = {line.rank for line in _logs(sessions, job_id)}
    assert {0, 1} <= ranks, f"both ranks' output is in the job's log, got ranks {ranks}"


def test_a_sigkilled_rank_restarts_and_resumes_from_its_sdk_checkpoint(
    settings: Settings, sessions: sessionmaker, code_sha: str
) -> None:
    job_id = _submit(sessions, settings, code_sha, "--steps", "40", "--step-seconds", "0.1", max_restarts=1)
    thread, out = run_in_thread(settings, job_id)
    wait_step(sessions, job_id, 5)
    # The user's program of rank 1: a child of the rank wrapper whose RANK is 1.
    wrappers = [p for p in rank_processes(job_id) if "workers.command.main" in " ".join(p.cmdline())]
    rank1 = next(p for p in wrappers if p.environ().get("RANK") == "1")
    for child in rank1.children():
        child.send_signal(signal.SIGKILL)
    thread.join(timeout=120)
    assert out == [JobStatus.QUEUED], "the attempt ends with a restart"
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED
    job = job_row(sessions, job_id)
    assert job.status == "succeeded" and job.attempt == 2 and job.step == 40
    second = [line.line for line in _logs(sessions, job_id) if line.attempt == 2 and line.rank == 0]
    assert any("resumed after step" in line for line in second), "the restart resumed from a checkpoint"
    assert rank_processes(job_id) == []


def test_cancel_asks_the_script_to_stop_and_it_checkpoints_first(
    settings: Settings, sessions: sessionmaker, code_sha: str
) -> None:
    job_id = _submit(sessions, settings, code_sha, "--steps", "100000", "--step-seconds", "0.05")
    thread, out = run_in_thread(settings, job_id)
    wait_step(sessions, job_id, 3)
    with sessions.begin() as s:
        service.cancel(s, user=ensure_bootstrap_admin(s, token=ADMIN_TOKEN), job_id=job_id)
    # The script sees should_stop() and exits by itself; SIGTERM follows only after the grace.
    _wait_gone(job_id, settings.cancel_grace_seconds * 2 + 5)
    thread.join(timeout=60)
    assert out == [JobStatus.CANCELLED]
    stopped = [line.line for line in _logs(sessions, job_id) if "as dptrain asked" in line.line]
    assert len(stopped) == 2, f"both ranks saw should_stop(): {stopped}"
    step = int(stopped[0].split("after step ")[1].split()[0])
    with sessions() as s:
        steps = [c.step for c in repository.checkpoints(s, job_id=job_id)]
    assert steps[-1] == step, f"the script checkpointed the step it stopped after ({step}), got {steps}"


def test_the_ranks_see_no_secret_of_the_worker(
    settings: Settings, sessions: sessionmaker, code_sha: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPTRAIN_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("DPTRAIN_BROKER_URL", "amqp://guest:secret-broker@127.0.0.1//")
    monkeypatch.setenv("DPTRAIN_BOOTSTRAP_TOKEN", "secret-bootstrap-token-0123456789")
    monkeypatch.setenv("DPTRAIN_TOKEN", "secret-client-token")
    job_id = _submit(
        sessions,
        settings,
        code_sha,
        "--steps",
        "1",
        "--print-env",
        resources={"processes_per_node": 1},
        env={"MY_SETTING": "visible"},
    )
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED
    printed = "\n".join(line.line for line in _logs(sessions, job_id))
    assert "MY_SETTING=visible" in printed, "the job's own env reaches the script"
    assert "RANK=0" in printed and "MASTER_ADDR=" in printed, "torchrun's variables reach it"
    for secret in ("secret-broker", "secret-bootstrap-token", "secret-client-token", settings.database_url):
        assert secret not in printed, f"{secret!r} leaked into a rank's environment"
    assert "DPTRAIN_DATABASE_URL" not in printed and "DPTRAIN_BROKER_URL" not in printed


def test_a_script_that_hangs_ends_after_the_stall_timeout_with_no_process_left(
    settings: Settings, sessions: sessionmaker, code_sha: str
) -> None:
    job_id = _submit(sessions, settings, code_sha, "--sleep-forever", stall_timeout_seconds=10)
    started = time.monotonic()
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.FAILED
    took = time.monotonic() - started
    error = JobError.model_validate(job_row(sessions, job_id).error)
    assert error.type == "Stalled" and "no progress for 10 s" in error.message, error
    assert took < 10 + settings.cancel_grace_seconds + 30, f"ended {took:.0f} s after it started"
    assert rank_processes(job_id) == []
    assert not [p for p in psutil.process_iter(["cmdline"]) if _sleeps_for(p, job_id)]


def _sleeps_for(proc: psutil.Process, job_id: str) -> bool:
    """A `--sleep-forever` process of this job (by its environment: another run of this test may be live)."""
    if "--sleep-forever" not in (proc.info["cmdline"] or []):
        return False
    try:
        return proc.environ().get("DPTRAIN_JOB_ID") == job_id
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def test_a_reference_in_the_command_expands_from_the_ranks_environment_without_a_shell(
    settings: Settings, sessions: sessionmaker, tmp_path: Path
) -> None:
    data_root = (tmp_path / "data").resolve()
    (data_root / "shakespeare_char").mkdir(parents=True)
    (data_root / "shakespeare_char" / "meta.txt").write_text("vocab 65\n")
    tree = tmp_path / "tree"
    tree.mkdir()
    # Reads the file its --dataset names: a `$(...)` left as written would be a FileNotFoundError.
    (tree / "show.py").write_text(
        "import pathlib, sys\n"
        "dataset = sys.argv[1].removeprefix('--dataset=')\n"
        "print('read', (pathlib.Path(dataset) / 'meta.txt').read_text().strip(), 'from', dataset)\n"
        "print('literal', sys.argv[2])\n"
    )
    node = settings.model_copy(update={"data_root": data_root})
    # torchrun would read `$$` and `${local_rank}` itself: the wrapper alone expands.
    literal = "$$(RANK)$(NO_SUCH)${local_rank}"
    command = ["python", "show.py", "--dataset=$(DPTRAIN_DATA_ROOT)/shakespeare_char", literal]
    job_id = submit_as_admin(
        sessions,
        {
            "name": "expand",
            "command": command,
            "code": {"sha256": store_code(node, tree, tmp_path)},
            "resources": {"processes_per_node": 1},
        },
        settings=settings,
    )
    ended = run_attempt(job_id=job_id, settings=node)
    printed = [line.line for line in _logs(sessions, job_id)]
    assert ended is JobStatus.SUCCEEDED, printed
    assert f"read vocab 65 from {data_root}/shakespeare_char" in printed, printed
    assert "literal $(RANK)$(NO_SUCH)${local_rank}" in printed, f"escaped and unset: as written {printed}"


# nanoGPT's pattern: rank 0 saves into its out_dir, every rank resumes from there after a restart.
# Attempt 1 saves, then every rank dies by SIGKILL (retried); attempt 2 finds the save and finishes.
RESUMING_SCRIPT = """
import os, signal
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
out = os.environ["DPTRAIN_OUTPUT_DIR"]
ckpt = os.path.join(out, "ckpt.pt")
resumed = os.path.exists(ckpt)
dist.barrier()
if not resumed:
    if rank == 0:
        with open(ckpt, "wb") as f:
            f.write(b"state at step 3")
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)
with open(ckpt, "rb") as f:
    state = f.read()
print(f"rank {rank} resumed from {state!r}", flush=True)
if rank == 0:
    os.makedirs(os.path.join(out, "final"), exist_ok=True)
    with open(os.path.join(out, "final", "model.bin"), "wb") as f:
        f.write(b"trained from " + state)
dist.barrier()
dist.destroy_process_group()
"""


def _artifacts(api: TestClient, job_id: str) -> list[dict[str, Any]]:
    r = api.get(f"/v1/jobs/{job_id}/artifacts")
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


def test_a_script_resumes_from_its_output_dir_and_its_outputs_become_artifacts(
    settings: Settings, sessions: sessionmaker, api: TestClient, tmp_path: Path
) -> None:
    spec = {
        "name": "outputs",
        "command": ["python", "-c", RESUMING_SCRIPT],
        "resources": {"processes_per_node": 2},
        "hyperparameters": {"steps": 1},
        "max_restarts": 1,
    }
    job_id = submit_as_admin(sessions, spec, settings=settings)
    # A kill by signal is retried: the job is queued for its second attempt.
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.QUEUED, _logs_text(sessions, job_id)
    saved = hashlib.sha256(b"state at step 3").hexdigest()
    listed = _artifacts(api, job_id)
    assert listed == [{"path": "ckpt.pt", "size_bytes": 15, "sha256": saved}], "each attempt's end lists them"
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED, _logs_text(sessions, job_id)
    lines = [line.line for line in _logs(sessions, job_id)]
    assert {"rank 0 resumed from b'state at step 3'", "rank 1 resumed from b'state at step 3'"} <= set(lines)
    final = b"trained from state at step 3"
    listed = _artifacts(api, job_id)
    assert listed == [
        {"path": "ckpt.pt", "size_bytes": 15, "sha256": saved},
        {"path": "final/model.bin", "size_bytes": len(final), "sha256": hashlib.sha256(final).hexdigest()},
    ]
    r = api.get(f"/v1/jobs/{job_id}/artifacts/final/model.bin")
    assert r.status_code == 200 and r.content == final
    assert r.headers["X-Artifact-SHA256"] == hashlib.sha256(final).hexdigest()


WRITE_2KB = "import os; open(os.environ['DPTRAIN_OUTPUT_DIR'] + '/big.bin', 'wb').write(b'x' * 2048)"


@pytest.mark.parametrize(
    ("then", "when"),
    [("", "at the attempt's end"), ("; import time; time.sleep(600)", "while the ranks run")],
)
def test_outputs_over_the_cap_fail_the_job_unretried(
    settings: Settings, sessions: sessionmaker, then: str, when: str
) -> None:
    spec = {
        "name": "too-much",
        "command": ["python", "-c", WRITE_2KB + then],
        "hyperparameters": {"steps": 1},
        "max_restarts": 1,
    }
    job_id = submit_as_admin(sessions, spec, settings=settings)
    capped = settings.model_copy(update={"max_output_bytes_per_job": 1024})
    assert run_attempt(job_id=job_id, settings=capped) is JobStatus.FAILED, when
    error = JobError.model_validate(job_row(sessions, job_id).error)
    assert error.type == "OutputTooLarge", error
    assert "2.0 KiB (2048 bytes)" in error.message and "1.0 KiB (1024 bytes)" in error.message, error.message
    assert job_row(sessions, job_id).attempt == 1, "not retried"
