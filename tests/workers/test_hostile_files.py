"""What a job's ranks leave in their run directory is read as hostile input (issue 38, findings 1 and 4).

Real command jobs under the runner, the sandbox required (this test runs as root, as a cluster
worker does), on PostgreSQL and on SQLite:

- a job that replaces its own log with a link to a host file, plants links in logs/ and events/
  (to the file and to its folder), swaps logs/ itself for a link to the host folder and links an
  output to the file never gets the host file's marker into anything the API answers: its log,
  metrics, timeline, error, artifacts;
- a job that prints 20 MiB under a 1 MiB log budget leaves a log file on disk near the budget (the
  worker empties it once read past it), its stored log ends with the budget's marker, and it succeeds.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from api_schemas import JobStatus
from migrations import upgrade
from service.app import create_app
from service.config import Settings
from service.db import session_factory
from tests.api_fixtures import ADMIN_TOKEN, RecordingScheduler
from tests.backends import BACKENDS
from tests.workers.runs import node_settings, run_attempt, submit_as_admin

pytestmark = pytest.mark.e2e

MIB = 1 << 20
CAP = MIB
FLOOD_MIB = 20

HOSTILE = """
import os, sys, time
secret, secret_dir = sys.argv[1], sys.argv[2]
run, out = os.environ["DPTRAIN_RUN_DIR"], os.environ["DPTRAIN_OUTPUT_DIR"]
logs, events = os.path.join(run, "logs"), os.path.join(run, "events")
print("hostile job started", flush=True)
time.sleep(1.5)  # read by the worker before the log is replaced
def plant(path, target):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.symlink(target, path)
# Its own log (the rank keeps writing to the unlinked file), new names, a folder named like a log.
for path in ("rank0.log", "x.log", "launcher.log"):
    plant(os.path.join(logs, path), secret)
for path in ("rank0.jsonl", "rank1.jsonl"):
    plant(os.path.join(events, path), secret)
plant(os.path.join(out, "leak.txt"), secret)
time.sleep(1.5)  # the worker reads its folders a few times meanwhile
# Then a link to a folder named like a log, and the folders themselves swapped for links to it.
plant(os.path.join(logs, "d.log"), secret_dir)
time.sleep(1.5)
os.rename(logs, logs + ".old")
os.symlink(secret_dir, logs)
os.rename(events, events + ".old")
os.symlink(secret_dir, events)
time.sleep(1.5)
"""

FLOOD = f"""
import os, sys, time
chunk = ("x" * 1023 + "\\n") * 1024
biggest = 0
for _ in range({FLOOD_MIB}):
    sys.stdout.write(chunk)
    sys.stdout.flush()
    biggest = max(biggest, os.fstat(1).st_size)
    time.sleep(0.3)
with open(os.path.join(os.environ["DPTRAIN_OUTPUT_DIR"], "biggest"), "w") as f:
    f.write(str(biggest))
"""


@pytest.fixture(scope="module", params=BACKENDS)
def settings(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """A root worker node on either database, the sandbox required, a log budget of CAP bytes."""
    home = tmp_path_factory.mktemp(f"node-{request.param}")
    if request.param == "postgresql":
        url = request.getfixturevalue("own_database")
    else:
        url = f"sqlite:///{home / 'dptrain.db'}"
        upgrade(url)
    return node_settings(url, home).model_copy(update={"sandbox": "required", "max_log_bytes_per_job": CAP})


@pytest.fixture(scope="module")
def api(settings: Settings) -> Iterator[TestClient]:
    """The API on the node's database, as the admin."""
    admin = settings.model_copy(update={"bootstrap_token": SecretStr(ADMIN_TOKEN)})
    with TestClient(
        create_app(admin, scheduler=RecordingScheduler()), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ) as client:
        yield client


def _run(settings: Settings, program: str, *args: str) -> str:
    spec = {
        "name": "hostile",
        "command": ["python", "-c", program, *args],
        "resources": {"processes_per_node": 1},
        "stall_timeout_seconds": 120,
    }
    job_id = submit_as_admin(session_factory(settings), spec, settings=settings)
    run_attempt(job_id=job_id, settings=settings)
    return job_id


def _everything(api: TestClient, job_id: str) -> dict[str, str]:
    """The API's answers about the job by route: its row, log, metrics, timeline, artifacts, checkpoints."""
    answers = {}
    for route in ("", "/logs?limit=10000", "/metrics", "/timeline", "/artifacts", "/checkpoints"):
        r = api.get(f"/v1/jobs/{job_id}{route}")
        assert r.status_code == 200, (route, r.text)
        answers[route or "/"] = r.text
    return answers


def test_links_planted_in_the_run_directory_never_show_a_host_file(
    settings: Settings, api: TestClient, tmp_path: Path
) -> None:
    marker = f"HOSTFILE-{uuid.uuid4().hex}"
    host = tmp_path / "host-secrets"
    host.mkdir()
    secret = host / "secret.log"
    # A plain line, and events a reader following the links would take for the job's own.
    secret.write_text(
        f"{marker} plain line\n"
        + json.dumps({"type": "metrics", "step": 1, "values": {marker: 1.0}})
        + "\n"
        + json.dumps({"type": "warning", "rank": 0, "message": marker})
        + "\n"
    )
    secret.chmod(0o600)
    (host / "rank0.jsonl").write_text(secret.read_text())
    (host / "other.log").write_text(secret.read_text())
    job_id = _run(settings, HOSTILE, str(secret), str(host))

    answers = _everything(api, job_id)
    leaked = [route for route, text in answers.items() if marker in text]
    assert leaked == [], f"the host file's marker reached {leaked}:\n" + "\n".join(
        f"{r}: {answers[r][:2000]}" for r in leaked
    )
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == JobStatus.SUCCEEDED.value, (job["status"], job["error"])
    log = [item["line"] for item in api.get(f"/v1/jobs/{job_id}/logs?limit=10000").json()["items"]]
    assert "hostile job started" in log, log
    refused = [line for line in log if "was not read: it is a link or not a regular file" in line]
    assert any("'logs/x.log'" in line for line in refused), f"expected the refusal said in the log: {log}"


def test_a_log_flood_leaves_a_file_near_the_budget_and_the_stored_log_ends_with_the_marker(
    settings: Settings, api: TestClient
) -> None:
    job_id = _run(settings, FLOOD)
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == JobStatus.SUCCEEDED.value, (job["status"], job["error"])
    on_disk = settings.artifacts / "jobs" / job_id / "attempt-1" / "node-0" / "logs" / "rank0.log"
    # The budget, plus one chunk the rank writes between two reads, plus one for a busy machine.
    bound = CAP + 2 * MIB
    assert on_disk.stat().st_size <= bound, f"{on_disk} holds {on_disk.stat().st_size} bytes, over {bound}"
    biggest = int((settings.artifacts / "jobs" / job_id / "outputs" / "biggest").read_text())
    assert biggest <= bound, f"the log file grew to {biggest} bytes while the job ran, over {bound}"
    items = api.get(f"/v1/jobs/{job_id}/logs?limit=10000").json()["items"]
    assert items, "no log stored"
    last = items[-1]["line"]
    assert last.startswith("[dptrain] attempt 1 dropped") and "DPTRAIN_MAX_LOG_BYTES_PER_JOB" in last, last
    stored = sum(len(item["line"].encode()) for item in items if not item["line"].startswith("[dptrain]"))
    assert stored <= CAP, f"{stored} bytes of lines stored over the {CAP} budget"
