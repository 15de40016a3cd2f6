"""What a job reports about its checkpoints is not trusted: real ranks in the sandbox, on PostgreSQL.

A job's checkpoint file is its own folder's file of the step, never a path its ranks name; its
checkpoint folder is capped; and its checkpoint list matches the files on disk however an attempt
ends (issue 38, findings 2, 4 and 6).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from rank_contract.layout import JobFiles
from service.app import create_app
from service.config import Settings
from service.models import LogLine
from service.users import service as users
from tests.api_fixtures import RecordingScheduler, as_user
from tests.workers.runs import job_row, node_fixtures, run_attempt, run_in_thread, timeline
from workers.attempt.node_run import RunPaths

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()

# Bob's job: a checkpoint saved through the SDK, an output, a log line and an env secret.
VICTIM = """
import os, dptrain, torch
dptrain.save_checkpoint({"w": torch.full((4,), 7.0), "note": "BOB-CKPT-SECRET"}, 1)
open(os.path.join(os.environ["DPTRAIN_OUTPUT_DIR"], "secret.txt"), "w").write("BOB-OUTPUT-SECRET")
print("BOB-LOG-SECRET", flush=True)
"""
# Alice's job forges rank 0's checkpoint events: one per path of Bob's it was given, and one for a
# step whose file is a link it planted to Bob's checkpoint.
FORGER = """
import json, os, sys, time
ckpts = os.environ["DPTRAIN_CHECKPOINT_DIR"]
os.symlink(sys.argv[1], os.path.join(ckpts, "ckpt-000000099.pt"))
lines = [
    {"type": "checkpoint", "time": time.time(), "step": step, "path": path, "size_bytes": 1,
     "sha256": "0" * 64, "deleted": []}
    for step, path in enumerate([*sys.argv[1:], os.path.join(ckpts, "ckpt-000000099.pt")], start=1)
]
lines[-1]["step"] = 99
events = os.path.join(os.environ["DPTRAIN_RUN_DIR"], "events", "rank0.jsonl")
with open(events, "a") as f:
    f.write("".join(json.dumps(line) + "\\n" for line in lines))
"""
SECRETS = (b"BOB-CKPT-SECRET", b"BOB-OUTPUT-SECRET", b"BOB-LOG-SECRET", b"BOB-ENV-SECRET")


@pytest.fixture(scope="module")
def sandboxed(settings: Settings) -> Settings:
    """The node's settings with the sandbox required: no job of this module runs outside it."""
    return settings.model_copy(update={"sandbox": "required", "cancel_grace_seconds": 1.0})


@pytest.fixture(scope="module")
def api(settings: Settings) -> Iterator[TestClient]:
    """The API on the node's database, with no token of its own: each request names its user."""
    with TestClient(create_app(settings, scheduler=RecordingScheduler())) as client:
        yield client


@pytest.fixture(scope="module")
def tokens(sessions: sessionmaker[Session]) -> dict[str, str]:
    """Two users granted code: Bob (the victim) and Alice (who forges)."""
    with sessions.begin() as s:
        return {
            name: users.create(s, name=name, admin=False, can_run_code=True).token
            for name in ("bob", "alice")
        }


def _submit(api: TestClient, token: str, spec: dict[str, Any]) -> str:
    r = api.post(
        "/v1/jobs", json={"name": "t", "hyperparameters": {"steps": 1}, **spec}, headers=as_user(token)
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _command(script: str, *args: str) -> dict[str, Any]:
    return {"command": ["python", "-c", script, *args]}


def test_a_forged_checkpoint_event_never_hands_out_another_users_files(
    api: TestClient, sandboxed: Settings, sessions: sessionmaker[Session], tokens: dict[str, str]
) -> None:
    bob = _submit(api, tokens["bob"], {**_command(VICTIM), "env": {"WANDB_API_KEY": "BOB-ENV-SECRET"}})
    assert run_attempt(job_id=bob, settings=sandboxed) is JobStatus.SUCCEEDED, job_row(sessions, bob).error
    bob_paths = RunPaths(JobFiles(sandboxed.artifacts, bob), 1)
    (bob_ckpt,) = bob_paths.job.checkpoints.glob("ckpt-*.pt")
    bob_log = next((bob_paths.run.folder / "logs").glob("rank*.log"), bob_paths.run.launcher_log)
    victims = [bob_ckpt, bob_paths.run.spec, bob_paths.job.outputs / "secret.txt", bob_log]
    assert bob_ckpt.exists() and (bob_paths.job.outputs / "secret.txt").exists(), "Bob's files are there"

    alice = _submit(api, tokens["alice"], _command(FORGER, *map(str, victims)))
    assert run_attempt(job_id=alice, settings=sandboxed) is JobStatus.SUCCEEDED, job_row(
        sessions, alice
    ).error

    headers = as_user(tokens["alice"])
    items = api.get(f"/v1/jobs/{alice}/checkpoints", headers=headers).json()["items"]
    for item in items:
        r = api.get(f"/v1/jobs/{alice}/checkpoints/{item['id']}/download", headers=headers)
        leaked = [s.decode() for s in SECRETS if s in r.content]
        assert r.status_code == 404 and not leaked, f"step {item['step']}: {r.status_code}, leaked {leaked}"
    assert items == [], f"a forged event must list nothing: {items}"
    notes = " ".join(reason or "" for _, reason in timeline(sessions, alice))
    assert "checkpoint of step 99 not listed: ckpt-000000099.pt is not a regular file" in notes, notes
    assert "checkpoint of step 1 not listed: ckpt-000000001.pt is not in the job's checkpoint folder" in notes
    for init in ({"job": alice}, {"job": alice, "step": 1}, {"job": alice, "step": 99}):
        r = api.post("/v1/jobs", json={"name": "i", "init_from": init}, headers=headers)
        assert r.status_code == 422, f"init_from {init}: expected 422, got {r.status_code} {r.text}"


JUNK_200_MIB = (
    "import os; f = open(os.path.join(os.environ['DPTRAIN_CHECKPOINT_DIR'], 'junk.bin'), 'wb'); "
    "f.truncate(200 << 20); f.close()"
)


@pytest.mark.parametrize(
    ("then", "when"),
    [("", "at the attempt's end"), ("; import time; time.sleep(600)", "while the ranks run")],
)
def test_a_checkpoint_folder_over_its_cap_fails_the_job_naming_the_cap(
    api: TestClient,
    sandboxed: Settings,
    sessions: sessionmaker[Session],
    tokens: dict[str, str],
    then: str,
    when: str,
) -> None:
    # A sparse file: its size counts (what a copy or a download of it costs), so it is cheap to test.
    job_id = _submit(api, tokens["alice"], {**_command(JUNK_200_MIB + then), "max_restarts": 1})
    capped = sandboxed.model_copy(update={"max_checkpoint_bytes_per_job": 64 << 20})
    started = time.monotonic()
    assert run_attempt(job_id=job_id, settings=capped) is JobStatus.FAILED, when
    assert time.monotonic() - started < 120, f"stopped {when} only after {time.monotonic() - started:.0f} s"
    error = JobError.model_validate(job_row(sessions, job_id).error)
    assert error.type == "CheckpointTooLarge", error
    assert "64.0 MiB" in error.message and "DPTRAIN_MAX_CHECKPOINT_BYTES_PER_JOB" in error.message, (
        error.message
    )
    assert job_row(sessions, job_id).attempt == 1, "not retried: the same script fills it again"


# Saves steps 1 and 2 (keep_last 2), then step 3, whose pruning of step 1 it never finishes: the
# cancel's signal comes while that save is under way, as a cancel during a long save would.
CANCELLED_SAVE = """
import sys, time, dptrain, torch
import workers.engine.checkpoint as checkpoint
for step in (1, 2):
    dptrain.save_checkpoint({"w": torch.full((1 << 20,), float(step))}, step)
def stuck(*args, **kwargs):
    print("pruning", flush=True)
    time.sleep(600)
checkpoint.CheckpointManager._prune = stuck
dptrain.save_checkpoint({"w": torch.full((1 << 20,), 3.0)}, 3)
"""


def _logged(sessions: sessionmaker[Session], job_id: str, text: str) -> bool:
    with sessions() as s:
        return s.query(LogLine).filter_by(job_id=job_id).filter(LogLine.line.contains(text)).count() > 0


def test_a_cancel_during_a_save_leaves_a_checkpoint_list_that_matches_the_disk(
    api: TestClient, sandboxed: Settings, sessions: sessionmaker[Session], tokens: dict[str, str]
) -> None:
    headers = as_user(tokens["alice"])
    job_id = _submit(api, tokens["alice"], {**_command(CANCELLED_SAVE), "checkpoint": {"keep_last": 2}})
    thread, result = run_in_thread(sandboxed, job_id)
    deadline = time.monotonic() + 120
    while not _logged(sessions, job_id, "pruning") and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.2)
    assert _logged(sessions, job_id, "pruning"), "the job never reached the save of step 3"
    assert api.post(f"/v1/jobs/{job_id}/cancel", headers=headers).status_code == 200
    thread.join(timeout=120)
    assert result == [JobStatus.CANCELLED], result
    listed = [c["step"] for c in api.get(f"/v1/jobs/{job_id}/checkpoints", headers=headers).json()["items"]]
    folder = sandboxed.artifacts / "jobs" / job_id / "checkpoints"
    on_disk = sorted(
        int(p.name[5:14]) for p in folder.glob("ckpt-*.pt") if p.is_file() and not p.is_symlink()
    )
    assert listed == on_disk == [1, 2, 3], f"listed {listed}, on disk {on_disk}"
    for item in api.get(f"/v1/jobs/{job_id}/checkpoints", headers=headers).json()["items"]:
        r = api.get(f"/v1/jobs/{job_id}/checkpoints/{item['id']}/download", headers=headers)
        assert r.status_code == 200, f"step {item['step']} is listed but answers {r.status_code}"
