"""workers.command.main on real processes: the program's log, exit code, error event, signals, cleanup."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from rank_contract.env import SUPERVISOR_ENV
from rank_contract.layout import RunFiles
from workers.engine.events import ErrorEvent, parse_event
from workers.engine.process import supervisor_id
from workers.sandbox.procs import rank_processes, sweep_ranks

ROOT = Path(__file__).resolve().parents[2]
# A program that says it is ready with its pid, then waits to be signalled.
WAITS = "import os, time; print('ready', os.getpid(), flush=True); time.sleep(60)"

pytestmark = pytest.mark.e2e


def _start(
    run_dir: Path, *cmd: str, rank: int = 0, job_id: str = "job-x", **env: str
) -> subprocess.Popen[bytes]:
    argv = ["--job-id", job_id, "--on-node", "n0", "--run-dir", str(run_dir), "--", *cmd]
    return subprocess.Popen(
        [sys.executable, "-m", "workers.command.main", *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), **env},
    )


def _log(run_dir: Path, rank: int = 0) -> str:
    path = run_dir / "logs" / f"rank{rank}.log"
    return path.read_text() if path.exists() else ""


def _ready_pid(run_dir: Path) -> int:
    deadline = time.monotonic() + 30
    while not (m := re.search(r"^ready (\d+)$", _log(run_dir), re.M)):
        assert time.monotonic() < deadline, f"the program never got ready: {_log(run_dir)!r}"
        time.sleep(0.05)
    return int(m.group(1))


def _errors(run_dir: Path, rank: int = 0) -> list[ErrorEvent]:
    path = RunFiles(run_dir).rank_events(rank)
    events = [parse_event(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in events if isinstance(e, ErrorEvent)]


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_program_that_succeeds_logs_its_output_and_exits_0(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "print('out', sys.executable, os.environ['PYTHONUNBUFFERED'])\n"
        "print('err', file=sys.stderr)"
    )
    rank = _start(tmp_path, "python", "-c", code)
    assert rank.wait(timeout=60) == 0
    # `python` is the worker's interpreter (it has torch and the SDK), unbuffered.
    assert f"out {sys.executable} 1\nerr\n" in _log(tmp_path)
    assert _errors(tmp_path) == []


@pytest.mark.parametrize(
    ("cmd", "code", "error_type", "message"),
    [
        (["python", "-c", "import sys; sys.exit(3)"], 3, "ProcessExited", "rank 1 exited with code 3"),
        (["python", "-c", "import json\nraise ValueError('bad input')"], 1, "ValueError", "bad input"),
        (
            ["python", "-c", "import os; os.kill(os.getpid(), 9)"],
            137,
            "ProcessKilled",
            "rank 1 was killed by SIGKILL",
        ),
        (["no-such-program-dptrain"], 127, "CommandNotFound", "command not found: no-such-program-dptrain"),
    ],
    ids=["exit-code", "traceback", "killed", "not-found"],
)
def test_a_failed_program_is_an_error_event_and_its_exit_code(
    tmp_path: Path, cmd: list[str], code: int, error_type: str, message: str
) -> None:
    assert _start(tmp_path, *cmd, rank=1).wait(timeout=60) == code
    [error] = _errors(tmp_path, rank=1)
    assert (error.rank, error.error_type) == (1, error_type)
    assert error.message.startswith(message), error.message
    if error_type == "ValueError":
        assert error.traceback is not None and "Traceback (most recent call last):" in error.traceback
        assert error.traceback.endswith("ValueError: bad input")


def test_a_signal_to_the_rank_reaches_the_program_and_the_rank_waits_for_it(tmp_path: Path) -> None:
    code = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('saving', flush=True), sys.exit(0)))\n"
        "print('ready', os.getpid(), flush=True)\n"
        "time.sleep(60)"
    )
    rank = _start(tmp_path, "python", "-c", code)
    _ready_pid(tmp_path)
    rank.send_signal(signal.SIGTERM)
    assert rank.wait(timeout=30) == 0, "the program handled SIGTERM and exited 0; so does the rank"
    assert "saving" in _log(tmp_path)


def test_the_supervisors_death_kills_the_rank_and_its_program(tmp_path: Path) -> None:
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rank = _start(tmp_path, "python", "-c", WAITS, **{SUPERVISOR_ENV: supervisor_id(supervisor.pid)})
        program = _ready_pid(tmp_path)
    finally:
        supervisor.kill()
        supervisor.wait()
    assert rank.wait(timeout=30) == -signal.SIGKILL
    assert _gone(program), "the program must die with its rank"
    assert "supervisor" in _log(tmp_path)


def test_sweep_ranks_kills_a_rank_and_the_program_in_its_group(tmp_path: Path) -> None:
    job_id = f"sweep-{uuid.uuid4().hex[:8]}"
    rank = _start(tmp_path, "python", "-c", WAITS, job_id=job_id)
    program = _ready_pid(tmp_path)
    assert [p.pid for p in rank_processes(job_id)] == [rank.pid], "the program carries no job id"
    assert sweep_ranks(job_id) == 2
    rank.wait(timeout=10)  # psutil has reaped it already (its code reads 0 then): it is gone
    assert _gone(program)
