"""`dptrain up` outlives its worker: a SIGKILLed worker is started again while the API keeps serving.

The job the dead worker was running is not lost: the new worker ends it as lost at its start, and it
is requeued (it has a restart to spend) and resumed to success; a job submitted afterwards runs too.
SIGTERM still stops `up`, the new worker included, within 10 s.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import job_spec
from tests.e2e.helpers import Procs, clean_env, wait_for_terminal, wait_healthy
from workers.sandbox.procs import rank_processes

pytestmark = pytest.mark.e2e

STEPS = 40
# A long job the kill lands in, with a restart to spend on its lost worker.
LONG = job_spec(
    name="outlives-its-worker",
    hyperparameters={"global_batch_size": 8, "steps": STEPS, "hidden_size": 8},
    resources={"processes_per_node": 1, "device": "cpu"},
    engine={"log_every_steps": 1},
    checkpoint={"every_steps": 4, "keep_last": 2},
    max_restarts=1,
)
RESTART_SECONDS = 120  # the backoff's first second, then a Celery worker's start on a loaded machine
STOP_SECONDS = 10


def _worker(up: psutil.Process) -> psutil.Process | None:
    """The worker among `up`'s children, found by its command line (`... dptrain_cli.main worker ...`)."""
    for child in up.children():
        try:
            cmd = child.cmdline()
        except psutil.Error:  # gone, or a zombie, since it was listed
            continue
        if "dptrain_cli.main" in cmd and cmd[cmd.index("dptrain_cli.main") + 1 :][:1] == ["worker"]:
            return child
    return None


def _wait_step(http: httpx.Client, job_id: str, step: int, procs: Procs) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] == "running" and job["progress"]["step"] >= step:
            return
        assert job["status"] in ("queued", "running"), job
        procs.check_alive()
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} never reached step {step}:\n{procs.logs()}")


def test_a_sigkilled_worker_is_started_again_and_the_api_serves_throughout(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    home, port = tmp_path / "home", free_port()
    base = f"http://127.0.0.1:{port}"
    # Every step sleeps, so that the kill lands mid-run (workers/engine/faults.py).
    env = clean_env(
        DPTRAIN_HOME=str(home), DPTRAIN_REPORT_INTERVAL_SECONDS="0.2", DPTRAIN_FAULT_INJECT="sleep:ms=150"
    )
    procs = Procs(tmp_path)
    procs.start("up", ["up", "--port", str(port)], env, cwd=tmp_path)
    try:
        wait_healthy(base, procs, timeout=90)
        up = psutil.Process(procs.popen("up").pid)
        auth = {"Authorization": f"Bearer {(home / 'token').read_text().strip()}"}
        http = httpx.Client(base_url=base, headers=auth, timeout=30)
        r = http.post("/v1/jobs", json=LONG)
        assert r.status_code == 201, r.text
        long_id = r.json()["id"]
        _wait_step(http, long_id, 3, procs)

        first = _worker(up)
        assert first is not None, f"no worker among {up.children()}:\n{procs.logs()}"
        os.kill(first.pid, signal.SIGKILL)

        answered, second = 0, None
        deadline = time.monotonic() + RESTART_SECONDS
        while second is None and time.monotonic() < deadline:
            procs.check_alive()  # `up` itself
            try:
                health = httpx.get(f"{base}/healthz", timeout=5).status_code
            except httpx.HTTPError as exc:
                raise AssertionError(f"the API stopped answering: {exc!r}\n{procs.logs()}") from exc
            assert health == 200, f"the API answered {health} while the worker was down"
            answered += 1
            second = _worker(up)
            if second is not None and second.pid == first.pid:
                second = None  # not yet reaped: the same, dead, process
            time.sleep(0.2)
        assert second is not None, f"no new worker {RESTART_SECONDS} s after the kill:\n{procs.logs()}"
        assert answered > 1 and not first.is_running(), (answered, first)

        long_job = wait_for_terminal(http, long_id, procs=procs, timeout=240)
        timeline: list[dict[str, Any]] = http.get(f"/v1/jobs/{long_id}/timeline").json()["items"]
        short = http.post("/v1/jobs", json=job_spec(name="after-the-restart"))
        assert short.status_code == 201, short.text
        short_job = wait_for_terminal(http, short.json()["id"], procs=procs, timeout=120)
        assert second.is_running(), "the new worker ran the jobs and is still up"
        took = procs.signal("up", signal.SIGTERM, timeout=STOP_SECONDS)
        assert not second.is_running() or second.status() == psutil.STATUS_ZOMBIE, (
            f"worker left ({took:.1f} s)"
        )
    finally:
        procs.stop()

    said = " ".join(procs.output("up").split())
    assert "the worker exited with -9; starting it again in 1 s" in said, procs.output("up")
    assert said.count("starting it again") == 1, procs.output("up")
    # Not lost: ended as lost by the new worker, requeued on its restart, resumed to the end.
    assert long_job["status"] == "succeeded" and long_job["attempt"] == 2, (long_job, procs.logs())
    assert long_job["progress"]["step"] == STEPS, long_job
    requeues = [t["reason"] or "" for t in timeline if t["to_status"] == "queued"][1:]
    assert len(requeues) == 1 and "lost" in requeues[0], f"one requeue for the lost worker: {timeline}"
    assert rank_processes(long_id) == [], "no rank of either attempt may be left"
    assert short_job["status"] == "succeeded", (short_job, procs.logs())
