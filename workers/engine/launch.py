"""Build the torchrun command line for an engine run (importable without importing torch)."""

from __future__ import annotations

import os
import sys
import threading
import time

# "pid:start time" of the process supervising the ranks (the worker's runner). Each rank exits when
# it is gone: ranks of a SIGKILLed worker must not train on, writing checkpoints beside the next
# attempt's, and torchrun runs in a session of its own, so the worker's death does not reach them.
SUPERVISOR_ENV = "DPTRAIN_SUPERVISOR"


def _start_time(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (/proc/PID/stat field 22), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    return stat.rsplit(")", 1)[1].split()[19]


def supervisor_id(pid: int | None = None) -> str:
    """The value of SUPERVISOR_ENV for this process (start time guards against pid reuse)."""
    pid = pid or os.getpid()
    return f"{pid}:{_start_time(pid)}"


def watch_supervisor(value: str | None, *, interval: float = 1.0) -> threading.Thread | None:
    """Exit this process (code 70) as soon as the supervisor named by `value` is gone."""
    if not value or ":" not in value or not os.path.isdir("/proc"):
        return None
    pid_s, start = value.split(":", 1)
    pid = int(pid_s)

    def watch() -> None:
        while _start_time(pid) == start:
            time.sleep(interval)
        print(f"supervisor {pid} is gone: this rank exits", file=sys.stderr, flush=True)
        os._exit(70)

    thread = threading.Thread(target=watch, name="dptrain-supervisor-watch", daemon=True)
    thread.start()
    return thread


def torchrun_command(
    *,
    job_id: str,
    nproc: int,
    spec_path: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str],
) -> list[str]:
    """The argv that launches `nproc` engine ranks on this host for one job."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "workers.engine.main",
        "--job-id",
        job_id,
        "--spec",
        os.fspath(spec_path),
        "--run-dir",
        os.fspath(run_dir),
        "--checkpoint-dir",
        os.fspath(checkpoint_dir),
    ]
