"""`dptrain up` as a service: what it prints, how it stops, and the job it stopped that resumes next time.

One job of 4 CPU ranks (more than this machine's cores: `up`'s default slots run it anyway) lives
through three `up` processes on one DPTRAIN_HOME: SIGTERM (systemd, `docker stop`) stops the
first, SIGINT (Ctrl-C) the second, each within 10 s and leaving no process behind; the third runs
the job to its end, resumed from a checkpoint each time, succeeded once, with no restart charged.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from rank_contract.layout import RunFiles
from tests.conftest import job_spec
from tests.e2e.helpers import Procs, clean_env, wait_for_terminal, wait_healthy
from workers.sandbox.procs import rank_processes

pytestmark = pytest.mark.e2e

STEPS = 40
RANKS = 4
SPEC = job_spec(
    name="up-lifecycle",
    hyperparameters={"global_batch_size": 8, "steps": STEPS, "lr": 0.1, "hidden_size": 8},
    resources={"processes_per_node": RANKS, "device": "cpu"},
    engine={"log_every_steps": 1},
    checkpoint={"every_steps": 4, "keep_last": 2},
)
STOP_SECONDS = 10


class Up:
    """`dptrain up` on one home, started again and again, and its API."""

    def __init__(self, tmp: Path, port: int) -> None:
        self.home = tmp / "home"
        self.port, self.base = port, f"http://127.0.0.1:{port}"
        # Every step sleeps, so that a signal lands mid-run (workers/engine/faults.py).
        self.env = clean_env(
            DPTRAIN_HOME=str(self.home),
            DPTRAIN_REPORT_INTERVAL_SECONDS="0.2",
            DPTRAIN_FAULT_INJECT="sleep:ms=150",
        )
        self.procs = Procs(tmp)
        self.runs = 0

    def start(self) -> tuple[str, httpx.Client]:
        self.runs += 1
        name = f"up{self.runs}"
        self.procs.start(name, ["up", "--port", str(self.port)], self.env, cwd=self.procs.log_dir)
        wait_healthy(self.base, self.procs, timeout=90)
        auth = {"Authorization": f"Bearer {(self.home / 'token').read_text().strip()}"}
        return name, httpx.Client(base_url=self.base, headers=auth, timeout=30)

    def stop(self, name: str, sig: signal.Signals, job_id: str) -> None:
        """Signal `up` alone; it must be gone within STOP_SECONDS with everything it started."""
        up = psutil.Process(self.procs.popen(name).pid)
        started = up.children(recursive=True)
        ranks = {p.pid for p in rank_processes(job_id)}
        assert len(ranks) > RANKS, f"expected torchrun's agent and {RANKS} ranks, found pids {ranks}"
        assert ranks <= {p.pid for p in started}, "the job's ranks must be among what `up` started"
        took = self.procs.signal(name, sig, timeout=STOP_SECONDS)
        left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"{sig.name}: {left} outlived `up` ({took:.1f} s):\n{self.procs.logs()}"


def _wait_running(http: httpx.Client, job_id: str, *, attempt: int, step: int, up: Up) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] == "running" and job["attempt"] == attempt and job["progress"]["step"] >= step:
            return
        assert job["status"] in ("queued", "running"), job
        up.procs.check_alive()
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} attempt {attempt} never reached step {step}:\n{up.procs.logs()}")


def _events(run_dir: Path) -> list[dict[str, Any]]:
    """The events rank 0 of one attempt wrote (workers/engine/events.py)."""
    lines = RunFiles(run_dir).rank_events(0).read_text().splitlines()
    return [json.loads(line) for line in lines]


def _submit_unplaceable(up: Up, tmp: Path) -> subprocess.CompletedProcess[str]:
    """`dptrain submit --wait` of a job for 2 nodes, which the one embedded node can never hold."""
    spec = tmp / "two-nodes.yaml"
    spec.write_text(yaml.safe_dump(job_spec(SPEC, name="two-nodes", resources={"nodes": 2})))
    cmd = [sys.executable, "-m", "dptrain_cli.main", "submit", str(spec), "--wait"]
    env = {**up.env, "DPTRAIN_API_URL": up.base}
    return subprocess.run(
        [*cmd, "--unplaceable-timeout", "1", "--timeout", "120"], capture_output=True, text=True, env=env
    )


def test_a_job_outlives_sigterm_and_sigint_of_up_and_completes_once(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    up = Up(tmp_path, free_port())
    try:
        name, http = up.start()
        banner = up.procs.output(name)
        token_file = up.home / "token"
        for line in (
            f"dashboard  {up.base}/",
            f"token      {token_file}",
            f'curl -H "Authorization: Bearer $(cat {token_file})" {up.base}/v1/jobs',
            f"({RANKS} rank slots)",
        ):
            assert line in banner, f"expected {line!r} in the banner of `dptrain up`:\n{banner}"

        r = http.post("/v1/jobs", json=SPEC)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        _wait_running(http, job_id, attempt=1, step=6, up=up)
        up.stop(name, signal.SIGTERM, job_id)

        name, http = up.start()
        _wait_running(http, job_id, attempt=2, step=18, up=up)
        up.stop(name, signal.SIGINT, job_id)

        name, http = up.start()
        job = wait_for_terminal(http, job_id, procs=up.procs, timeout=180)
        timeline: list[dict[str, Any]] = http.get(f"/v1/jobs/{job_id}/timeline").json()["items"]
        series = http.get(f"/v1/jobs/{job_id}/metrics", params={"name": "loss"}).json()["series"]
        unplaceable = _submit_unplaceable(up, tmp_path)
    finally:
        up.procs.stop()

    assert job["status"] == "succeeded", f"{job['status']}: {job['error']}\n{up.procs.logs()}"
    # Said at once, and `submit --wait` ends with its own code instead of waiting out --timeout.
    said = " ".join(unplaceable.stderr.split())
    assert unplaceable.returncode == 5, unplaceable.stdout + unplaceable.stderr
    assert "warning: no live node can hold this job: it needs 2 nodes" in said, said
    # The default max_restarts (0) still allowed both: a stopped service is not the job's failure.
    assert job["attempt"] == 3 and job["spec"]["max_restarts"] == 0, job
    states = [t["to_status"] for t in timeline]
    assert states == ["queued", "running", "queued", "running", "queued", "running", "succeeded"], timeline
    for requeue in (timeline[2], timeline[4]):
        assert "WorkerStopped" in requeue["reason"] and "not counted" in requeue["reason"], requeue
    assert [s for s, _ in series["loss"]] == list(range(1, STEPS + 1)), f"one loss per step: {series}"

    job_dir = up.home / "artifacts" / "jobs" / job_id
    events = {n: _events(job_dir / f"attempt-{n}" / "node-0") for n in (1, 2, 3)}
    steps = {n: [e["step"] for e in ev if e["type"] == "metrics"] for n, ev in events.items()}
    finished = {n: [e["step"] for e in ev if e["type"] == "finished"] for n, ev in events.items()}
    # Trained to the end once: the stopped attempts never reached the last step nor finished.
    assert finished == {1: [], 2: [], 3: [STEPS]} and STEPS not in steps[1] + steps[2], (finished, steps)
    # Each later attempt resumed from a checkpoint of the one before, not from scratch.
    for before, after in ((1, 2), (2, 3)):
        start = next(e["start_iter"] for e in events[after] if e["type"] == "started")
        assert 0 < start <= steps[before][-1] and steps[after][0] == start + 1, (after, start, steps)
