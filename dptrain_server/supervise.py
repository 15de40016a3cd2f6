"""`dptrain up` as a small supervisor: its children stopped in order on SIGTERM or SIGINT, none left behind.

uvicorn (0.29 and later) raises the signal that stopped it again once it has shut down, so a SIGTERM
used to end `up` (which ran the API in its own process) before its `finally` could stop the
worker: the worker, and the ranks of its jobs, kept running under PID 1. So `up` runs no server
itself. It starts the worker and the API as children, each in a session of its own (a Ctrl-C in
the terminal reaches `up` alone, which stops them in order), handles SIGTERM and SIGINT itself,
and stops the API first (nothing new is submitted or placed), then the worker (which stops its
ranks and hands their attempts back, workers/attempt/runner.py), each with a bounded wait, then SIGKILLs
whatever of its descendants is left.

A worker that dies while `up` is not stopping (an OOM kill, a crash) is started again after a
backoff, and the API keeps serving meanwhile: the new worker ends the runs its predecessor left
`running` before it places anything (docs/reliability.md, "Stopping a worker"), so their jobs are
requeued or failed as for any lost worker, never left hanging. A dead API still stops `up`: one
that cannot bind its port would otherwise be retried forever behind a prompt that looks alive.

As their subreaper, `up` also reaps what it adopts: every sandbox's init outlives its bwrap (which
exits without reaping it) and becomes `up`'s child, and a zombie left unreaped counts as alive to
whoever waits for it to go. Its own children it leaves to their Popen, which needs their exit status.
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
from dataclasses import dataclass, field
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
# A restarted child waits 1 s, then 2, 4, ... up to 30 s while it keeps dying within a minute of
# its start (a broken configuration must not spin); one that lived longer is restarted after 1 s.
RESTART_FIRST_SECONDS = 1.0
RESTART_MAX_SECONDS = 30.0
RESTART_HEALTHY_SECONDS = 60.0

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
class Backoff:
    """The wait before each restart of a child: doubling while it keeps dying young, reset once it lived."""

    first: float = RESTART_FIRST_SECONDS
    most: float = RESTART_MAX_SECONDS
    healthy_after: float = RESTART_HEALTHY_SECONDS
    _next: float = field(default=0.0, init=False)

    def delay(self, *, lived: float) -> float:
        """Seconds to wait before starting again a child that died `lived` seconds after its start."""
        if self._next == 0.0 or lived >= self.healthy_after:
            self._next = self.first
        delay, self._next = self._next, min(self._next * 2, self.most)
        return delay


@dataclass
class Child:
    """A process `up` started: how to start it again, how long it may take to stop after SIGTERM."""

    name: str
    args: list[str]
    env: dict[str, str]
    stop_seconds: float
    # None: its exit stops `up`; else the wait before it is started again.
    backoff: Backoff | None
    proc: subprocess.Popen[bytes] = field(init=False)
    started: float = field(default=0.0, init=False)
    # When a dead child is due to start again (time.monotonic()), or None while it runs.
    restart_at: float | None = field(default=None, init=False)


class Supervisor:
    """Starts `dptrain` subcommands, waits for a signal or for one of them to exit, then stops them all."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.signalled: int | None = None
        self.hurry = False
        # Set by SIGCHLD: a child exited, ours or adopted; the main loop reaps the adopted ones.
        self.reap_due = False
        signal.signal(signal.SIGCHLD, self._on_child)
        # From before the first child starts: a signal meanwhile still stops what was started.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._prctl = _prctl()
        if self._prctl is not None:
            # Orphans of our children (torchrun and ranks of a worker that died first) become ours,
            # so the final sweep finds them among our descendants.
            self._prctl(PR_SET_CHILD_SUBREAPER, 1)

    def start(
        self,
        name: str,
        args: list[str],
        *,
        env: Mapping[str, str],
        stop_seconds: float,
        restart: bool = False,
    ) -> None:
        """Start `dptrain ARGS` in a session of its own; it gets SIGTERM if `up` dies without stopping it.

        With `restart`, its exit while `up` is not stopping starts it again after a backoff;
        without, its exit stops `up`.
        """
        child = Child(name, list(args), dict(env), stop_seconds, Backoff() if restart else None)
        self._spawn(child)
        self.children.append(child)

    def _spawn(self, child: Child) -> None:
        child.proc = subprocess.Popen(
            [sys.executable, "-m", "dptrain_cli.main", *child.args],
            env=child.env,
            start_new_session=True,
            # Safe here: `up` starts no thread, ever (preexec_fn and threads do not mix).
            preexec_fn=self._die_with_us(),
        )
        child.started, child.restart_at = time.monotonic(), None

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
        """Until SIGTERM or SIGINT, or the exit of a child not restarted; then stop every child.

        The exit code for `up`.
        """
        ended: Child | None = None
        while self.signalled is None and ended is None:
            time.sleep(POLL_SECONDS)
            self._reap_adopted()
            ended = next((c for c in self.children if not self._tend(c)), None)
        if ended is not None and self.signalled is None:
            # Jobs nobody can see or cancel are worse than none: without its API, `up` stops.
            console.print(f"[red]the {ended.name} exited with {ended.proc.returncode}; stopping[/red]")
        else:
            console.print(f"{signal.Signals(self.signalled or signal.SIGTERM).name}: stopping")
        self.stop()
        return 0 if self.signalled is not None else 1

    def _tend(self, child: Child) -> bool:
        """Restart `child` if it died and may be restarted (after its backoff); False if it ended `up`."""
        if self.signalled is not None:
            # Stopping (systemd signals every process of the unit at once): a child's exit now is
            # its part in that, never a crash to repair.
            return True
        now = time.monotonic()
        if child.restart_at is not None:
            if now >= child.restart_at:
                try:
                    self._spawn(child)
                except OSError as exc:  # out of processes or memory, say: try again later
                    child.restart_at = now + (child.backoff or Backoff()).delay(lived=0.0)
                    console.print(f"[yellow]could not start the {child.name}: {exc}[/yellow]")
            return True
        code = child.proc.poll()
        if code is None:
            return True
        if child.backoff is None:
            return False
        # What it started (torchrun, ranks) was adopted by us: end it before its successor starts,
        # so no rank of a run the successor ends as lost goes on writing beside its next attempt.
        self._sweep_orphans()
        delay = child.backoff.delay(lived=now - child.started)
        child.restart_at = now + delay
        console.print(
            f"[yellow]the {child.name} exited with {code}; starting it again in {delay:g} s[/yellow]"
        )
        return True

    def _sweep_orphans(self) -> None:
        # A live child's descendants stay under it: what else is ours was left by a dead one.
        alive = {c.proc.pid for c in self.children if c.proc.poll() is None}
        orphans = [p for p in _children(os.getpid()) if p.pid not in alive]
        left = [q for p in orphans for q in (p, *_descendants(p.pid))]
        _kill(left)

    def _reap_adopted(self) -> None:
        """Reap the adopted processes that exited since the last SIGCHLD, never a child of our own."""
        if not self.reap_due:
            return
        self.reap_due = False  # before the look: an exit during it signals again
        # Not waitpid(-1): it could take the exit status of the API or the worker from their Popen.
        ours = {c.proc.pid for c in self.children if c.proc.returncode is None}
        for p in _children(os.getpid()):
            if p.pid not in ours:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(p.pid, os.WNOHANG)  # (0, 0) for one still running

    def _on_child(self, signum: int, frame: FrameType | None) -> None:
        self.reap_due = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A second signal (an impatient Ctrl-C) stops waiting for anyone: SIGKILL what is left.
        self.hurry = self.signalled is not None
        self.signalled = self.signalled or signum

    def stop(self) -> None:
        """Stop the children in the reverse order of their start, each with its bounded wait, then sweep."""
        seen: dict[int, psutil.Process] = {}
        for child in reversed(self.children):
            if child.proc.poll() is None:  # a dead one's pid may be another process's by now
                seen |= {p.pid: p for p in _descendants(child.proc.pid)}
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + child.stop_seconds
                while child.proc.poll() is None and time.monotonic() < deadline and not self.hurry:
                    time.sleep(POLL_SECONDS)
                    self._reap_adopted()  # the worker's stop kills sandboxes, whose inits come to us
            if child.proc.poll() is None:
                console.print(f"[yellow]the {child.name} did not stop in time; killing it[/yellow]")
                child.proc.kill()
            child.proc.wait()
        # What the children left: the processes seen under them (a rank whose torchrun died is in
        # no process group of theirs) and any orphan we adopted as subreaper.
        seen |= {p.pid: p for p in _descendants(os.getpid())}
        _kill(list(seen.values()))

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


def _children(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children())
    except psutil.NoSuchProcess:
        return []


def _kill(procs: list[psutil.Process]) -> None:
    """SIGKILL `procs` and wait for them (reaping those that are our children)."""
    left = [p for p in procs if p.is_running()]
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=3)
