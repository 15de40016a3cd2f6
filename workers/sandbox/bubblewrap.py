"""The bubblewrap sandbox every attempt's ranks run in: what they see, who they are, how they end.

One bwrap per node of an attempt wraps torchrun (and so every rank, whatever the job runs):

- its own PID namespace, whose init bwrap runs: when torchrun exits, or the sandbox is killed, the
  kernel kills whatever else the job started (double forks, `setsid`, daemons) with it;
  `--die-with-parent` does the same when the worker dies, which replaces the ranks' watch on the
  worker's pid (DPTRAIN_SUPERVISOR): that pid does not exist inside;
- its own mount namespace on an empty root: the system (/usr, /etc, ...) and the worker's Python
  (its prefixes and our packages' folders, never a repository root, which may hold the default
  DPTRAIN_HOME) read-only, the job's code tree and the data root read-only, the attempt's run
  directory and the job's checkpoints and outputs writable at their host paths (the runner's paths stay
  valid), /tmp backed by the run directory's `tmp/`, a fresh /proc, /dev and /dev/shm. Nothing
  else of the host: no DPTRAIN_HOME, database, token, other job's folder or host process;
- its own IPC and UTS namespaces; the network stays (multi-node rendezvous needs it);
- never root: a root worker starts bwrap as root, which needs no user namespace and can bind the
  worker's private folders, and the sandbox switches to the ranks' user (DPTRAIN_RUN_AS, else the
  attempt's own uid: workers/sandbox/rank_uids.py) with setpriv before torchrun starts: no capabilities, no
  new privileges. A worker that is not root starts bwrap as itself (bwrap then makes a user
  namespace); its ranks keep its uid.

Signals: SIGTERM to bwrap kills it (and so, through --die-with-parent, the whole sandbox at once),
so a graceful stop signals the process group inside, led by the sandbox's init, which a signal from
outside its namespace never ends (init has no handler): `signal_sandbox`.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.metadata
import importlib.util
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

log = logging.getLogger(__name__)

BWRAP = "/usr/bin/bwrap"
# By absolute path: the ranks' PATH starts with the worker's interpreter's folder.
SETPRIV = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin") or "/usr/bin/setpriv"
INSTALL_HINT = "apt install bubblewrap"
# What `dptrain up` and `DPTRAIN_SANDBOX=off` say where ranks run without the sandbox.
NOT_ISOLATED = (
    "ranks are not sandboxed: they see the worker's files (DPTRAIN_HOME, its database and tokens, other "
    "jobs' folders) and processes, run as the worker's user, and what they start may outlive the job"
)
# The distribution whose packages the ranks import (the engine, the SDK, the rank contract, the wire
# models). Bound by folder: in development they are an editable install whose repository may hold
# the default DPTRAIN_HOME.
DISTRIBUTION = "dptrain"
# The host's system, read-only. Links (merged /usr) are recreated as links, not bound.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")
SANDBOX_TMP = "/tmp"
Mode = Literal["auto", "required", "off"]


@dataclass(frozen=True)
class Box:
    """What one sandbox shows and whose its processes are: folders by how they are bound, not by use.

    Its callers (an attempt's ranks: workers/sandbox/rank_setup.py; a job environment's installer:
    workers/pyenv/build.py) each say what their folders are; every field means something to each.
    """

    # The processes' working directory, inside one of the folders below.
    workdir: Path
    # The host folder behind the sandbox's /tmp.
    tmp_dir: Path
    # Bound read-write at their host paths (so the worker's paths stay valid inside).
    writable: tuple[Path, ...]
    # Bound read-only at their host paths, besides the system and the worker's Python.
    read_only: tuple[Path, ...] = ()
    gpus: bool = False
    # Who the processes run as when bwrap starts as root (it switches to them inside); None: bwrap's own.
    uid: int | None = None
    gid: int | None = None


def python_paths() -> list[Path]:
    """The worker's Python environment: its prefixes, and our packages' folders outside them."""
    paths = [Path(sys.base_prefix), Path(sys.prefix), Path(os.path.realpath(sys.executable)).parent]
    for name in _our_packages():
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            paths.append(Path(location))
    return _outermost(Path(os.path.realpath(p)) for p in paths)


@functools.cache
def _our_packages() -> list[str]:
    """The top-level packages of our installed distribution (every one of them, new ones included)."""
    tops = importlib.metadata.packages_distributions()
    found = [top for top, dists in tops.items() if DISTRIBUTION in dists]
    # Not installed (a checkout on PYTHONPATH): the packages beside this one.
    return found or [p.name for p in Path(__file__).parents[2].iterdir() if (p / "__init__.py").is_file()]


def _outermost(paths: Iterable[Path]) -> list[Path]:
    """`paths` without duplicates and without those inside another of them."""
    kept: list[Path] = []
    for p in sorted(set(paths), key=lambda p: len(p.parts)):
        if not any(p == k or k in p.parents for k in kept):
            kept.append(p)
    return kept


def _system() -> list[str]:
    args: list[str] = []
    for path in SYSTEM:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _resolver() -> list[Path]:
    """The file a resolv.conf that links out of /etc names (systemd-resolved's, under /run)."""
    resolv = Path(os.path.realpath("/etc/resolv.conf"))
    return [resolv] if Path("/etc") not in resolv.parents and resolv.is_file() else []


def _devices(gpus: bool) -> list[str]:
    args = ["--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm"]
    if gpus:
        for node in sorted(glob.glob("/dev/nvidia*")):
            args += ["--dev-bind", node, node]
    return args


def _parents(destinations: Sequence[Path]) -> list[str]:
    """`--dir` for every folder above a mount point: bwrap would make them 0700, closed to the ranks."""
    made_elsewhere = {Path(p) for p in (*SYSTEM, "/", "/dev", "/proc", SANDBOX_TMP)}
    system = [Path(p) for p in SYSTEM]
    made: list[Path] = []
    for dest in destinations:
        for parent in dest.parents:
            # Folders of the read-only system exist there; /tmp's are made in the attempt's tmp.
            if parent in made_elsewhere or any(s in parent.parents for s in system) or parent in made:
                continue
            made.append(parent)
    # Parents first, whatever order the mounts came in.
    return [a for p in sorted(made, key=lambda p: len(p.parts)) for a in ("--perms", "0755", "--dir", str(p))]


def bwrap_argv(box: Box, command: Sequence[str]) -> list[str]:
    """The argv that runs `command` (torchrun's) in the sandbox `box`, from the run's working directory."""
    ro = [*_resolver(), *python_paths(), *box.read_only]
    rw = _outermost(box.writable)
    binds = [("--ro-bind", p) for p in ro] + [("--bind", p) for p in rw]
    mounts: list[str] = []
    # Outer folders first: a mount inside another must come after it, or it is hidden.
    for flag, path in sorted(binds, key=lambda b: len(b[1].parts)):
        mounts += [flag, str(path), str(path)]
    # /tmp first: a host path under /tmp (a test's artifact root) then gets its mount point inside
    # the attempt's own tmp, never a /tmp that hides it.
    argv = [
        BWRAP,
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--die-with-parent",
        # No controlling terminal to share, and the init leads the group the runner signals.
        "--new-session",
        *_system(),
        "--proc",
        "/proc",
        *_devices(box.gpus),
        "--bind",
        str(box.tmp_dir),
        SANDBOX_TMP,
        *_parents([*ro, *rw, box.workdir]),
        *mounts,
        "--chdir",
        str(box.workdir),
        "--",
    ]
    return argv + _as_user(box.uid, box.gid) + list(command)


def _as_user(uid: int | None, gid: int | None) -> list[str]:
    """setpriv's switch to the ranks' user, for a bwrap started as root (empty otherwise)."""
    if uid is None or gid is None:
        return []
    # Clears every capability (the bounding set too) and sets no_new_privs: setuid programs stay plain.
    return [
        SETPRIV,
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


def nobody() -> tuple[int, int]:
    """nobody's (uid, gid) (65534 where none is named): the probe's user, a multi-node attempt's ranks'."""
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return 65534, 65534
    return entry.pw_uid, entry.pw_gid


@functools.cache
def probe(uid: int | None = None, gid: int | None = None) -> str | None:
    """Run bwrap for real, as the ranks would; None if it works, else why not (once per process and user)."""
    if not os.access(BWRAP, os.X_OK):
        return f"bubblewrap is not installed ({BWRAP} is missing): {INSTALL_HINT}"
    argv = [BWRAP, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session"]
    argv += [*_system(), "--proc", "/proc", *_devices(False), "--", *_as_user(uid, gid), "true"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap cannot run: {exc}"
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return f"bubblewrap cannot make a sandbox here: {said[0]}"
    return None


class SandboxUnavailable(Exception):
    """DPTRAIN_SANDBOX asks for the sandbox and this host cannot make one."""


def unavailable(mode: Mode) -> str | None:
    """Why the ranks of this worker will not be sandboxed under `mode`; None when they will be."""
    if mode == "off":
        return "DPTRAIN_SANDBOX=off"
    # Tried as the ranks will run: a root worker's switch to an unprivileged user included.
    return probe(*(nobody() if os.getuid() == 0 else (None, None)))


def check_at_start(mode: Mode, *, embedded: bool) -> str | None:
    """At a worker's start: a warning if its ranks will run unsandboxed; SandboxUnavailable if they may not.

    Only the embedded single-user worker (`dptrain up`) may run without the sandbox under `auto`: a
    cluster's worker runs other people's code beside its secrets.
    """
    why = unavailable(mode)
    if why is None:
        return None
    if mode == "required" or (mode == "auto" and not embedded):
        raise SandboxUnavailable(
            f"{why}. This worker runs its jobs' ranks in a bubblewrap sandbox (DPTRAIN_SANDBOX={mode}); "
            f"install it ({INSTALL_HINT}) or allow namespaces (docs/security.md), or set DPTRAIN_SANDBOX=off "
            "to run them unisolated"
        )
    return f"{why}: {NOT_ISOLATED}"


def init_pid(proc: subprocess.Popen[bytes]) -> int | None:
    """The host pid of the sandbox's init (bwrap's one child), None before it exists or after it ended."""
    try:
        children = psutil.Process(proc.pid).children()
    except psutil.NoSuchProcess:
        return None
    return children[0].pid if children else None


def signal_sandbox(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send `sig` to torchrun's process group inside the sandbox (never its init or bwrap)."""
    if proc.poll() is not None:
        return  # bwrap has ended, so has its init, and with it every process of the sandbox
    pid = init_pid(proc)
    if pid is None:
        # Not started yet, or already ending: nothing inside to stop gracefully; bwrap takes it down.
        _kill(proc.pid, sig, group=True)
        return
    _kill(pid, sig, group=True)


def kill_sandbox(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the sandbox's init (the kernel then kills everything inside) and bwrap; wait for them."""
    if proc.poll() is not None:
        # bwrap exits after its init, and an init only once every process of its namespace is gone
        # (and its pid may be another process's by now).
        return
    init = init_pid(proc)
    box = None
    if init is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            box = psutil.Process(init)  # before the kill: once reaped, its pid may be another's
        _kill(init, signal.SIGKILL, group=False)
    _kill(proc.pid, signal.SIGKILL, group=True)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        log.error("bwrap (pid %s) did not exit after SIGKILL", proc.pid)
    if box is not None:
        _wait_ended(box, timeout=30)


def _wait_ended(init: psutil.Process, *, timeout: float) -> None:
    """Wait until the sandbox's init has exited: gone, or a zombie.

    An init's exit waits until the kernel has reaped every process of its namespace, so a zombie
    init is an empty sandbox. Its bwrap, killed with it, mostly dies first: then the init is no
    child of ours but of PID 1 or of `dptrain up` (their subreaper), and when they reap it is none
    of our business. psutil's wait for a process not our child counts a zombie as running.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if init.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    log.error("the sandbox's init (pid %s) did not exit after SIGKILL", init.pid)


def _kill(pid: int, sig: int, *, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if group else os.kill)(pid, sig)
