"""Every thread of every rank of this node's attempt, read with py-spy from outside the sandbox.

The ranks run in the sandbox's PID namespace (workers/sandbox/bubblewrap.py); the worker finds them by their
host pids (procs.rank_processes and their children) and runs `py-spy dump --pid` on each, which
attaches with ptrace for a moment. That needs ptrace rights over the ranks: a root worker has them
(CAP_SYS_PTRACE; a container needs it granted, `cap_add: [SYS_PTRACE]`); a worker that is not root
runs its ranks as its own uid and needs `kernel.yama.ptrace_scope` at 0 (py-spy is not the ranks'
parent) or a py-spy with `cap_sys_ptrace` (docs/security.md). Without py-spy or those rights the
dump says why instead, and the attempt goes on (or ends) as it would have.

Which processes: each process of the job that carries a RANK in its environment (a command's
program, what it started, a CUDA rank), and each fork of the CPU engine's agent (whose RANK is not
in /proc: the rank names its process instead, rank_contract/stacks.py). Never the launcher
(torchrun, the agent), the sandbox's bwrap, nor workers.command.main, which only waits on its program.

Where a process is (`where`), from its main thread's frames, innermost first:
1. the innermost frame of the user's code (a file outside the worker's Python installation and
   outside dptrain's own packages); failing that, of dptrain's own packages (an engine job);
2. the call it was making: the next frame inward, skipping decorators' wrapper frames
   (`wrapper`, `inner`, ...), named with the caller's place: "all_reduce (train.py:88)";
3. the frame itself when it was running its own line (a `time.sleep` is C, not a frame):
   "wait_for_peer (train.py:12)"; with no such frame at all, the innermost frame.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from api_schemas import ProcessStack, StackDump, StackFrame, StackReason, ThreadStack
from rank_contract.stacks import rank_of
from service.models.base import utcnow
from workers.sandbox.procs import rank_processes

log = logging.getLogger(__name__)

# A rank that py-spy cannot read in this long (a process stuck in the kernel) is noted, not waited on.
PY_SPY_TIMEOUT_SECONDS = 20
# Bounds on what one dump stores and logs: a script with thousands of threads or a deep recursion.
MAX_THREADS = 64
MAX_FRAMES = 64
# What one dump writes to the job's log at most (many ranks, each with many loader processes); the
# rest is cut with a line saying how much, and is in the stored dump.
MAX_LOG_LINES = 5000
# Decorators' frames between the user's call and the API it called (torch.distributed's collectives
# are wrapped by c10d_logger's `wrapper`; torch.no_grad's by `decorate_context`).
WRAPPER_NAMES = frozenset({"wrapper", "inner", "wrapped", "_fn", "decorate_context", "wrapper_fn"})
# The wrapper of a command job's rank: it only waits on the user's program (workers/command/main.py).
COMMAND_WRAPPER = "workers.command.main"
# py-spy's answer for a process that runs no Python (a shell, `sleep`): not a rank's stack, skipped.
NOT_PYTHON = "Failed to find python version"
PY_SPY_MISSING = "py-spy is not installed on this worker (pip install 'dptrain[worker]')"
PTRACE_HINT = "the worker needs ptrace rights over the ranks: docs/security.md"


def py_spy() -> str | None:
    """The py-spy executable: beside the worker's interpreter (its environment's), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


@dataclass(frozen=True)
class Target:
    """One process to dump: its host pid, its rank where its environment says, its command line."""

    pid: int
    rank: int | None
    command: str


def targets(job_id: str, *, node: str) -> list[Target]:
    """The processes of `job_id`'s ranks on worker node `node`, oldest first (see the module's docstring)."""
    found: dict[int, psutil.Process] = {}
    for p in rank_processes(job_id, node=node):
        found[p.pid] = p
        with contextlib.suppress(psutil.Error):
            found.update((c.pid, c) for c in p.children(recursive=True))
    out = []
    for p in sorted(found.values(), key=_created):
        try:
            cmd, env, parent, name = p.cmdline(), p.environ(), p.ppid(), p.name()
            forked = parent in found and found[parent].cmdline() == cmd
        except psutil.Error:
            continue  # gone meanwhile, or not ours to read
        if COMMAND_WRAPPER in cmd:
            continue  # the wrapper (and torchrun and bwrap, whose command lines name it)
        rank = env.get("RANK")
        if rank is None and not forked:
            continue  # the launcher (torchrun, the agent) or the sandbox's bwrap
        number = int(rank) if rank is not None and rank.isdigit() else rank_of(name)
        out.append(Target(pid=p.pid, rank=number, command=" ".join(cmd)))
    return out


def _created(p: psutil.Process) -> float:
    try:
        return p.create_time()
    except psutil.Error:
        return 0.0


def dump(job_id: str, *, node: str, attempt: int, reason: StackReason) -> StackDump:
    """Read the stacks of every rank of `job_id` on `node`, all at once."""
    taken_at = utcnow()
    found = targets(job_id, node=node)
    spy = py_spy()
    note = None
    if spy is None:
        note, processes = PY_SPY_MISSING, [_unread(t, PY_SPY_MISSING) for t in found]
    else:
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(found)))) as pool:
            read = list(pool.map(lambda t: _read(spy, t), found))
        processes = [p for p in read if p is not None]
        if refused := [p for p in processes if p.error]:
            note = f"{len(refused)} of {len(processes)} processes could not be read ({PTRACE_HINT})"
    if not found:
        note = "no rank process was found on this node"
    return StackDump(
        node=node, attempt=attempt, reason=reason, taken_at=taken_at, processes=processes, note=note
    )


def _unread(target: Target, why: str) -> ProcessStack:
    return ProcessStack(rank=target.rank, pid=target.pid, command=target.command, error=why)


def _read(spy: str, target: Target) -> ProcessStack | None:
    """One process's stacks; None if it runs no Python (a shell the program started)."""
    argv = [spy, "dump", "--pid", str(target.pid), "--json"]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_SECONDS, check=False
        )
    except subprocess.TimeoutExpired:
        return _unread(target, f"py-spy did not answer in {PY_SPY_TIMEOUT_SECONDS} s")
    except OSError as exc:
        return _unread(target, f"py-spy could not run: {exc}")
    if done.returncode != 0:
        why = next((ln for ln in done.stderr.splitlines() if ln.startswith("Error")), done.stderr.strip())
        if NOT_PYTHON in why:
            return None
        if not psutil.pid_exists(target.pid):
            return None  # it ended meanwhile
        return _unread(target, why[:500] or f"py-spy exited with {done.returncode}")
    try:
        threads = [_thread(t) for t in json.loads(done.stdout)[:MAX_THREADS]]
    except (ValueError, KeyError, TypeError) as exc:
        return _unread(target, f"py-spy's answer could not be read: {exc}")
    main = _main_thread(threads, target.pid)
    where = describe(main.frames, library=_library()) if main is not None else None
    return ProcessStack(
        rank=target.rank, pid=target.pid, command=target.command, where=where, threads=threads
    )


def _thread(raw: dict[str, Any]) -> ThreadStack:
    frames = [
        StackFrame(name=str(f["name"]), file=str(f["filename"]), line=int(f.get("line") or 0))
        for f in raw["frames"][:MAX_FRAMES]
    ]
    return ThreadStack(
        thread_id=int(raw.get("os_thread_id") or raw.get("thread_id") or 0),
        name=raw.get("thread_name"),
        active=bool(raw.get("active")),
        frames=frames,
    )


def _main_thread(threads: list[ThreadStack], pid: int) -> ThreadStack | None:
    for t in threads:
        if t.name == "MainThread" or t.thread_id == pid:
            return t
    return threads[0] if threads else None


@dataclass(frozen=True)
class Library:
    """Where code that is not the user's lives: the Python installation, and dptrain's own packages."""

    python: tuple[str, ...]
    ours: tuple[str, ...]


def _library() -> Library:
    python = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)}
    ours = set()
    for name in ("workers", "dptrain", "rank_contract", "api_schemas"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            ours.update(spec.submodule_search_locations)
    return Library(python=_both(python), ours=_both(ours))


def _both(paths: Iterable[str]) -> tuple[str, ...]:
    # As given and resolved: a frame names its file as the rank imported it.
    return tuple({os.path.join(f(p), "") for p in paths for f in (os.path.abspath, os.path.realpath)})


def _under(file: str, roots: tuple[str, ...]) -> bool:
    return file.startswith("<") or file.startswith(roots)


def describe(frames: list[StackFrame], *, library: Library) -> str | None:
    """The frame a thread is in, by the rule of the module's docstring; None for an empty stack."""
    if not frames:
        return None
    for is_caller in (
        lambda f: not _under(f.file, library.python + library.ours),
        lambda f: f.file.startswith(library.ours),
    ):
        at = next((i for i, f in enumerate(frames) if is_caller(f)), None)
        if at is None:
            continue
        caller = frames[at]
        place = f"{os.path.basename(caller.file)}:{caller.line}"
        called = [f for f in reversed(frames[:at]) if f.name.rsplit(".", 1)[-1] not in WRAPPER_NAMES]
        return f"{(called[0] if called else caller).name} ({place})"
    inner = frames[0]
    return f"{inner.name} ({os.path.basename(inner.file)}:{inner.line})"


def summary(stacks: StackDump) -> str:
    """Where each rank was, rank by rank: "rank 0 in all_reduce (train.py:88); rank 1 in ..."."""
    parts, seen = [], set()
    ordered = sorted(stacks.processes, key=lambda p: (p.rank is None, p.rank or 0))
    for p in ordered:
        if p.where is None or (p.rank is not None and p.rank in seen):
            continue  # a rank's first process is its program; later ones are what it started
        seen.add(p.rank)
        parts.append(f"{'rank ' + str(p.rank) if p.rank is not None else 'pid ' + str(p.pid)} in {p.where}")
    return "; ".join(parts) if parts else (stacks.note or "no stack could be read")


def log_lines(stacks: StackDump) -> list[tuple[int | None, str]]:
    """The dump as lines of the job's log, each under its rank."""
    lines: list[tuple[int | None, str]] = []
    for p in stacks.processes:
        who = f"rank {p.rank}" if p.rank is not None else "a rank"
        lines.append((p.rank, f"dptrain: stacks ({stacks.reason}) of {who}, pid {p.pid}: {p.command[:200]}"))
        if p.error:
            lines.append((p.rank, f"dptrain:   not read: {p.error}"))
        for t in p.threads:
            state = "active" if t.active else "idle"
            lines.append((p.rank, f"dptrain:   thread {t.thread_id} {t.name or ''} ({state})"))
            lines.extend((p.rank, f"dptrain:     {f.name} ({f.file}:{f.line})") for f in t.frames)
    if stacks.note:
        lines.append((None, f"dptrain: stacks ({stacks.reason}): {stacks.note}"))
    if len(lines) > MAX_LOG_LINES:
        cut = len(lines) - MAX_LOG_LINES + 1
        lines = [
            *lines[: MAX_LOG_LINES - 1],
            (None, f"dptrain: stacks ({stacks.reason}): {cut} more lines cut"),
        ]
    return lines


def row(stacks: StackDump, *, job_id: str, requested_at: datetime | None) -> dict[str, Any]:
    """The rank_stacks row of a dump."""
    return {
        "job_id": job_id,
        "attempt": stacks.attempt,
        "node": stacks.node,
        "reason": stacks.reason,
        "requested_at": requested_at,
        "taken_at": stacks.taken_at,
        "dump": stacks.model_dump(mode="json"),
    }
