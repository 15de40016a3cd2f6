"""The processes of a job on this host: torchrun's group, and ranks found by their command line."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess

import psutil

from workers.sandbox import bubblewrap

log = logging.getLogger(__name__)


def signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals, *, sandboxed: bool = False) -> None:
    """Send `sig` to torchrun's process group (in a sandbox the group inside it: bwrap would die of it)."""
    if sandboxed:
        bubblewrap.signal_sandbox(proc, sig)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop_group(proc: subprocess.Popen[bytes], *, grace: float, sandboxed: bool = False) -> None:
    """SIGTERM the launcher's whole process group, then SIGKILL what is left after `grace` seconds."""
    signal_group(proc, signal.SIGTERM, sandboxed=sandboxed)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    kill_group(proc, sandboxed=sandboxed)


def kill_group(proc: subprocess.Popen[bytes], *, sandboxed: bool = False) -> None:
    """SIGKILL torchrun's process group (a sandbox: everything in it) and reap torchrun (bwrap)."""
    if sandboxed:
        bubblewrap.kill_sandbox(proc)
        return
    signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        log.error("torchrun (pid %s) did not exit after SIGKILL", proc.pid)


def _has(cmd: list[str], flag: str, value: str) -> bool:
    return any(a == flag and b == value for a, b in zip(cmd, cmd[1:], strict=False))


def rank_processes(job_id: str, *, node: str | None = None) -> list[psutil.Process]:
    """Processes serving `job_id` (on worker node `node` only, if given), found by their command line."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if _has(cmd, "--job-id", job_id) and (node is None or _has(cmd, "--on-node", node)):
            found.append(p)
    return found


def sweep_ranks(job_id: str, *, node: str | None = None) -> int:
    """SIGKILL the live ranks of `job_id` (of node `node`) and their process groups; returns how many.

    Every rank leads a session of its own (plain torchrun starts CUDA ranks so; a rank forked by
    workers.engine.agent calls setsid), so killing torchrun's group does not reach a rank whose
    torchrun died first; the job id on every rank's command line does (a rank forked by
    workers.engine.agent shows the agent's, which carries it too). A command job's rank is
    workers.command.main, whose child, the user's program, carries no job id but runs in the
    rank's process group: the group finds it. Several nodes of one job may share a host, so a node
    sweeps only what carries its own `--node`.
    """
    procs = _with_groups(rank_processes(job_id, node=node))
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)
    return len(procs)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _with_groups(procs: list[psutil.Process]) -> list[psutil.Process]:
    """`procs` and every other process in their process groups (never the caller's own group)."""
    groups = {_pgid(p.pid) for p in procs} - {None, os.getpgrp()}
    found = {p.pid: p for p in procs}
    if groups:
        for p in psutil.process_iter():
            if p.pid not in found and _pgid(p.pid) in groups:
                found[p.pid] = p
    return list(found.values())


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` on this host, None if none does."""
    if not address:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None
