"""A rank's process, engine rank or command rank alike: its signals, session, output and supervisor.

Rank side: imported by workers.engine.main and workers.command.main inside the sandbox, and by the
node (supervisor_id) to name itself to its ranks; it imports neither side's other code, nor torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


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
    """The value of SUPERVISOR_ENV (rank_contract.env) for this process; its start time guards pid reuse."""
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


def redirect_output(log_path: Path) -> Callable[[], None]:
    """Point fds 1 and 2 (and so C/C++ output too) at `log_path`, appending; returns an undo function."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = (os.dup(1), os.dup(2))
    # 0600: a rank's output may print its data or its secrets; the worker, its owner, reads it.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line buffering, so the launcher shipping the file sees whole lines promptly, not 8 KiB blocks.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)

    def restore() -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])

    return restore


def default_signals() -> None:
    """Give this process the signal handlers of a fresh interpreter.

    A rank forked from torchrun's agent inherits the agent's handlers, which turn SIGTERM into an
    exception; a cancel (SIGTERM to the launcher's process group) must end a rank the way it ends a
    rank started by exec, without an error of its own.
    """
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def own_session() -> None:
    """Make this rank the leader of a session of its own, as plain torchrun starts every rank.

    A rank forked by workers.engine.agent is otherwise in the agent's session, and so, with the
    kernel's scheduler autogroups (one CPU scheduling group per session; on by default in Debian's
    kernel), in one group with its sibling ranks: their compute threads and Gloo's wake-ups then
    preempt each other as equals, where a session per rank lets the scheduler keep each rank's
    threads together. A cancel still reaches the rank: the agent
    forwards SIGTERM to each of its ranks, and the runner sweeps ranks by job id afterwards, as for
    plain torchrun's.
    """
    # A rank of plain torchrun already leads its session (start_new_session): setsid refuses then.
    with contextlib.suppress(PermissionError):
        os.setsid()
