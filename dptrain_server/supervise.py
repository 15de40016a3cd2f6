"""`dptrain up` as a small supervisor: its children stopped in order on SIGTERM or SIGINT, none left behind.

uvicorn (0.29 and later) raises the signal that stopped it again once it has shut down, so a SIGTERM
used to end `up` (which ran the API in its own process) before its `finally` could stop the
worker: the worker, and the ranks of its jobs, kept running under PID 1. So `up` runs no server
itself. It starts the worker and the API as children, each in a session of its own (a Ctrl-C in
the terminal reaches `up` alone, which stops them in order), handles SIGTERM and SIGINT itself,
and stops the API first (nothing new is submitted or placed), then the worker (which stops its
ranks and hands their attempts back, workers/runner.py), each with a bounded wait, then SIGKILLs
whatever of its descendants is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType

import psutil
from rich.console import Console

console = Console(stderr=True)

# How long each child may take to stop after its SIGTERM. The API stops in well under a second
# unless a dashboard's event stream holds it open; the worker stops its ranks (SIGKILL after
# runner.SHUTDOWN_GRACE_SECONDS) and records their end. Together with the final sweep, everything
# `up` started is gone within 10 s of the signal, the time `docker stop` waits before its SIGKILL.
API_STOP_SECONDS = 2.5
WORKER_STOP_SECONDS = 6.0
POLL_SECONDS = 0.1

# prctl(2) options (Linux): signal a child when its parent dies; adopt orphaned descendants.
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


@dataclass
class Child:
    """A process `up` started, and how long it may take to stop after SIGTERM."""

    name: str
    proc: subprocess.Popen[bytes]
    stop_seconds: float


class Supervisor:
    """Starts `dptrain` subcommands, waits for a signal or for one of them to exit, then stops them all."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.signalled: int | None = None
        self.hurry = False
        # From before the first child starts: a signal meanwhile still stops what was started.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._prctl = _prctl()
        if self._prctl is not None:
            # Orphans of our children (torchrun and ranks of a worker that died first) become ours,
            # so the final sweep finds them among our descendants.
            self._prctl(PR_SET_CHILD_SUBREAPER, 1)

    def start(self, name: str, args: list[str], *, env: Mapping[str, str], stop_seconds: float) -> None:
        """Start `dptrain ARGS` in a session of its own; it gets SIGTERM if `up` dies without stopping it."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "dptrain_cli.main", *args],
            env=dict(env),
            start_new_session=True,
            # Safe here: `up` has started no thread by then (preexec_fn and threads do not mix).
            preexec_fn=self._die_with_us(),
        )
        self.children.append(Child(name, proc, stop_seconds))

    def _die_with_us(self) -> Callable[[], None] | None:
        prctl, parent = self._prctl, os.getpid()
        if prctl is None:
            return None

        def preexec() -> None:
            # Even a SIGKILLed `up` (no chance to stop anything) stops its children this way.
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # `up` died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)

        return preexec

    def run(self) -> int:
        """Until SIGTERM or SIGINT, or a child's exit; then stop every child. The exit code for `up`."""
        ended: Child | None = None
        while self.signalled is None and ended is None:
            time.sleep(POLL_SECONDS)
            ended = next((c for c in self.children if c.proc.poll() is not None), None)
        if ended is not None and self.signalled is None:
            # A service that accepts jobs nobody runs (or runs jobs nobody can see) is worse than none.
            console.print(f"[red]the {ended.name} exited with {ended.proc.returncode}; stopping[/red]")
        else:
            console.print(f"{signal.Signals(self.signalled or signal.SIGTERM).name}: stopping")
        self.stop()
        return 0 if self.signalled is not None else 1

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A second signal (an impatient Ctrl-C) stops waiting for anyone: SIGKILL what is left.
        self.hurry = self.signalled is not None
        self.signalled = self.signalled or signum

    def stop(self) -> None:
        """Stop the children in the reverse order of their start, each with its bounded wait, then sweep."""
        seen: dict[int, psutil.Process] = {}
        for child in reversed(self.children):
            seen |= {p.pid: p for p in _descendants(child.proc.pid)}
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + child.stop_seconds
                while child.proc.poll() is None and time.monotonic() < deadline and not self.hurry:
                    time.sleep(POLL_SECONDS)
            if child.proc.poll() is None:
                console.print(f"[yellow]the {child.name} did not stop in time; killing it[/yellow]")
                child.proc.kill()
            child.proc.wait()
        # What the children left: the processes seen under them (a rank whose torchrun died is in
        # no process group of theirs) and any orphan we adopted as subreaper.
        seen |= {p.pid: p for p in _descendants(os.getpid())}
        left = [p for p in seen.values() if p.is_running()]
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(left, timeout=3)

    def reraise(self) -> None:
        """Die of the signal that stopped us, as uvicorn does, so systemd and shells see what happened."""
        if self.signalled is not None:
            signal.signal(self.signalled, signal.SIG_DFL)
            os.kill(os.getpid(), self.signalled)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []
