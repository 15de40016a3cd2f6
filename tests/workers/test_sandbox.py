"""Every attempt's ranks run in the bubblewrap sandbox: nothing they start outlives them, never as root.

Attempts run in this process as a worker node would (tests/workers/runs.py), on real ranks and
PostgreSQL. CI and this project's machines run the tests as root with bubblewrap installed.
"""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.auth.tokens import ensure_bootstrap_admin
from service.config import Settings
from service.jobs import service
from service.models import LogLine
from tests.api_fixtures import ADMIN_TOKEN
from tests.conftest import job_spec
from tests.workers.runs import job_row, node_fixtures, run_attempt, run_in_thread, submit_as_admin, timeline
from workers.sandbox import bubblewrap

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()

# Unique durations: other test runs on the host may have their own `sleep 600`s.
ORPHANS = ("600.417", "601.417")


def _command(sessions: sessionmaker[Session], settings: Settings, *command: str, **over: object) -> str:
    spec = {"name": "sandbox", "command": list(command), "hyperparameters": {"steps": 1}, **over}
    return submit_as_admin(sessions, spec, settings=settings)


def _lines(sessions: sessionmaker[Session], job_id: str) -> list[str]:
    with sessions() as s:
        return [r.line for r in s.query(LogLine).filter_by(job_id=job_id).order_by(LogLine.id)]


def _orphans() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if len(cmd) == 2 and cmd[0].endswith("sleep") and cmd[1] in ORPHANS:
            found.append(p)
    return found


def test_the_probe_finds_bubblewrap_here() -> None:
    uid_gid = bubblewrap.nobody() if os.getuid() == 0 else (None, None)
    assert bubblewrap.probe(*uid_gid) is None, (
        "these tests need bwrap (apt install bubblewrap) and namespaces"
    )


def test_processes_a_job_starts_are_gone_within_seconds_of_its_end(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    background = f"sleep {ORPHANS[0]} & setsid sleep {ORPHANS[1]} </dev/null >/dev/null 2>&1 & sleep 4"
    job_id = _command(sessions, settings, "bash", "-c", background)
    thread, out = run_in_thread(settings, job_id)
    deadline = time.monotonic() + 60
    while len(_orphans()) < 2 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_orphans()) == 2, "both background sleeps started (the test would prove nothing otherwise)"
    thread.join(timeout=120)
    assert out == [JobStatus.SUCCEEDED], out
    ended = time.monotonic()
    while _orphans() and time.monotonic() - ended < 10:
        time.sleep(0.2)
    left = [p.info["cmdline"] for p in _orphans()]
    assert left == [], f"processes the job started outlived it by 10 s: {left}"


def test_ranks_are_not_root_have_no_new_privileges_and_see_only_their_attempt(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    facts = {
        "uid": "os.getuid()",
        "euid": "os.geteuid()",
        "nnp": "[s.split()[1] for s in open('/proc/self/status') if s.startswith('NoNewPrivs')][0]",
        "cwd": "os.getcwd()",
        "tmp": "os.environ['TMPDIR']",
        "pids": "len([p for p in os.listdir('/proc') if p.isdigit()])",
        "cache_seen": f"os.path.exists({str(settings.code_cache)!r})",
        "supervisor": "os.environ.get('DPTRAIN_SUPERVISOR')",
    }
    probe = (
        "import json, os; print('FACTS', json.dumps({"
        + ", ".join(f"{k!r}: {v}" for k, v in facts.items())
        + "}))"
    )
    job_id = _command(sessions, settings, "python", "-c", probe)
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED
    printed = [line for line in _lines(sessions, job_id) if line.startswith("FACTS ")]
    assert printed, _lines(sessions, job_id)
    seen = json.loads(printed[0].removeprefix("FACTS "))
    assert seen["uid"] != 0 and seen["euid"] != 0, f"a rank ran as root: {seen}"
    assert seen["nnp"] == "1", f"no_new_privs is set: {seen}"
    assert seen["tmp"] == "/tmp", seen
    assert seen["cwd"].endswith("/attempt-1/node-0/work"), f"the attempt's own working directory: {seen}"
    # bwrap's init, torchrun, the rank's wrapper, its program (and Python's resource tracker at most).
    assert seen["pids"] < 10, f"the rank sees host processes in /proc: {seen}"
    assert seen["cache_seen"] is False, f"DPTRAIN_HOME's code cache is hidden: {seen}"
    assert seen["supervisor"] is None, "the worker's pid means nothing inside the sandbox's PID namespace"
    run_dir = settings.artifacts / "jobs" / job_id / "attempt-1" / "node-0"
    assert (
        not (run_dir / "work").exists() and not (run_dir / "tmp").exists() and not (run_dir / "home").exists()
    )
    assert (run_dir / "logs" / "rank0.log").is_file() and (run_dir / "spec.json").is_file()
    assert all("not sandboxed" not in (reason or "") for _, reason in timeline(sessions, job_id))


def test_a_cancel_still_reaches_the_program_inside_with_sigterm_first(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    # A program that ignores should_stop(): the runner's SIGTERM, after the grace, must reach it.
    script = "trap 'echo got TERM; exit 0' TERM; echo started; sleep 1000 & wait"
    job_id = _command(sessions, settings, "bash", "-c", script)
    thread, out = run_in_thread(settings, job_id)
    deadline = time.monotonic() + 60
    while "started" not in _lines(sessions, job_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    with sessions.begin() as s:
        service.cancel(s, user=ensure_bootstrap_admin(s, token=ADMIN_TOKEN), job_id=job_id)
    thread.join(timeout=settings.cancel_grace_seconds * 3 + 60)
    assert out == [JobStatus.CANCELLED], out
    assert "got TERM" in _lines(sessions, job_id), _lines(sessions, job_id)


def test_torch_compile_builds_and_caches_inside(settings: Settings, sessions: sessionmaker[Session]) -> None:
    # Inductor runs the system's C++ compiler on the worker's Python headers and writes its caches
    # under TMPDIR and HOME: the sandbox shows the first two read-only, and /tmp and HOME writable.
    spec = job_spec(
        name="compiled",
        hyperparameters={"global_batch_size": 8, "steps": 3, "hidden_size": 8},
        engine={"compile": True},
    )
    job_id = submit_as_admin(sessions, spec, settings=settings)
    assert run_attempt(job_id=job_id, settings=settings) is JobStatus.SUCCEEDED, job_row(
        sessions, job_id
    ).error
    assert job_row(sessions, job_id).step == 3


def test_sandbox_off_runs_unsandboxed_and_the_timeline_says_so(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    # Off on purpose: what this test checks is the operator's off switch and the timeline's word on it.
    off = settings.model_copy(update={"sandbox": "off"})
    job_id = _command(sessions, settings, "python", "-c", "import os; print('uid', os.getuid())")
    assert run_attempt(job_id=job_id, settings=off) is JobStatus.SUCCEEDED
    running = [reason or "" for status, reason in timeline(sessions, job_id) if status == "running"]
    assert len(running) == 1 and "ranks not sandboxed (DPTRAIN_SANDBOX=off)" in running[0], running
