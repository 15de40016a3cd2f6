"""Real processes for end-to-end tests: start dptrain commands, wait for them, poll jobs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from api_schemas import JobStatus
from service.jobs.lifecycle import can_transition
from tests.api_fixtures import ADMIN_TOKEN

ROOT = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any DPTRAIN_* settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPTRAIN_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def service_env(tmp: Path, *, db_url: str, broker_url: str, queue: str, **settings: str) -> dict[str, str]:
    """The environment of a test stack's API and workers: `clean_env` plus what every stack sets.

    Its database, broker and queue; artifacts under `tmp` (shared by every node, as NFS would be);
    the admin's token; reports and placement rounds quick enough for tests; then `settings`.
    """
    return clean_env(
        **{
            "DPTRAIN_DATABASE_URL": db_url,
            "DPTRAIN_BROKER_URL": broker_url,
            "DPTRAIN_QUEUE": queue,
            "DPTRAIN_ARTIFACT_ROOT": str(tmp / "artifacts"),
            "DPTRAIN_HOME": str(tmp / "home"),
            "DPTRAIN_BOOTSTRAP_TOKEN": ADMIN_TOKEN,
            "DPTRAIN_REPORT_INTERVAL_SECONDS": "0.2",
            "DPTRAIN_SCHEDULE_INTERVAL_SECONDS": "0.5",
            **settings,
        }
    )


class Procs:
    """Processes started by a test, each logging to a file; all stopped (with their groups) at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.dead: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self,
        name: str,
        args: list[str],
        env: Mapping[str, str],
        cwd: Path | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        """Start `dptrain ARGS` (behind `prefix`, e.g. `ip netns exec NS`, which execs it in place)."""
        log = (self.log_dir / f"{name}.log").open("ab")
        cmd = [*(prefix or []), sys.executable, "-m", "dptrain_cli.main", *args]
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env), cwd=cwd or ROOT, start_new_session=True
        )
        self.procs.append((name, proc))

    def kill(self, name: str) -> int:
        """SIGKILL a process's whole group, as a crash would; it is no longer checked. Returns its pid.

        torchrun runs in a session of its own, so the ranks of a killed worker survive it, as they
        would when a worker process dies on a real host.
        """
        for i, (n, proc) in enumerate(self.procs):
            if n == name:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=20)
                self.dead.append(self.procs.pop(i))
                return proc.pid
        raise KeyError(name)

    def popen(self, name: str) -> subprocess.Popen[bytes]:
        """The process started as `name` and still checked."""
        return next(proc for n, proc in self.procs if n == name)

    def signal(self, name: str, sig: int, *, timeout: float) -> float:
        """Send `sig` to the process alone (not its group), as systemd or `docker stop` would, and wait
        for it to exit; the seconds that took (AssertionError past `timeout`). It is no longer checked."""
        for i, (n, proc) in enumerate(self.procs):
            if n == name:
                started = time.monotonic()
                proc.send_signal(sig)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{name} still running {timeout} s after signal {sig}") from None
                self.dead.append(self.procs.pop(i))
                return time.monotonic() - started
        raise KeyError(name)

    def output(self, name: str) -> str:
        """Everything process `name` wrote so far."""
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(
            f"----- {name} -----\n" + (self.log_dir / f"{name}.log").read_text(errors="replace")[-6000:]
            for name, _ in [*self.dead, *self.procs]
        )

    def check_alive(self) -> None:
        for name, proc in self.procs:
            assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{self.logs()}"

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for _, proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=10)


def wait_healthy(base_url: str, procs: Procs, timeout: float = 60) -> None:
    """Wait until GET /healthz answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            if httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"API at {base_url} not healthy after {timeout} s:\n{procs.logs()}")


def wait_for_terminal(
    http: httpx.Client, job_id: str, *, procs: Procs, timeout: float = 180
) -> dict[str, Any]:
    """Poll a job to a terminal state, asserting every change seen is a legal transition (Ray's job tests)."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    last_step, attempt = 0, 0
    while time.monotonic() < deadline:
        r = http.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        job = r.json()
        status = job["status"]
        changed = not seen or status != seen[-1]
        if seen and changed:
            assert can_transition(JobStatus(seen[-1]), JobStatus(status)), f"illegal {seen[-1]} -> {status}"
        if changed:
            seen.append(status)
        if changed or job["attempt"] != attempt:
            # A restart resumes from its checkpoint, which may be behind the last step reported: the
            # requeue (a status change) and the new attempt each start the count again.
            last_step, attempt = 0, job["attempt"]
        assert job["progress"]["step"] >= last_step, "progress must never go backwards within an attempt"
        last_step = job["progress"]["step"]
        if JobStatus(status).is_terminal():
            return dict(job)
        procs.check_alive()
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not finished after {timeout} s (states {seen}):\n{procs.logs()}")
