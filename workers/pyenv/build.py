"""Build one job environment: a venv layered over the worker's, its packages installed by uv, in the sandbox.

The venv is made with the worker's interpreter (`uv venv` where uv is installed, else `python -m
venv`); a `.pth` file in its site-packages adds the worker's own site-packages after the venv's
(`site.addsitedir`, so the worker's own .pth files, editable installs included, apply): torch,
numpy and dptrain come from underneath, the job's packages sit on top.

uv installs them, with every distribution of the worker's environment excluded from its
resolution (`--excludes`): uv reads only the venv's own site-packages (it ignores layered and system
site-packages by design, astral-sh/uv#2101), so without the exclusions it would fetch a second numpy
or torch for any dependency. What the exclusions leave unchecked is checked afterwards with
`packaging`: every requirement of the installed distributions, and every line of the job's, that
names a worker distribution must be met by the worker's own version, else the build fails naming
both. So a job never replaces a package the worker's stack imports (torch, numpy, pydantic,
dptrain's...). Where uv is absent, pip run by the venv's interpreter installs instead: it sees the
worker's distributions as installed, and a constraints file pins the worker's torch and numpy. A
check afterwards refuses an environment whose files provide one of the worker's packages anyway
(a local wheel, a URL).

The installer runs in the same bubblewrap sandbox as the ranks, as their user (the attempt's own
uid under a root worker: workers/sandbox/rank_setup.ranks_user), seeing the worker's Python read-only and
only the environment's folder writable, with no cache shared between builds (a build runs the
job's own code: an sdist's build script must not reach another job's wheels). The sandbox shares
the host's network (no --unshare-net): the index must be reachable; nothing else of the host is
visible. uv's and pip's config files are ignored: the operator's DPTRAIN_PIP_* settings alone say
where packages come from. Its output streams into `log` (the job's `setup` log lines). The folder,
temporary files included, is measured every second while the build runs and the build stopped
past DPTRAIN_MAX_ENV_BYTES (EnvironmentTooLarge): a build never fills the disk before the cache's
cap is looked at.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import os
import shutil
import site
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from api_schemas import JobError
from rank_contract.failures import Failure
from rank_contract.files import create_beneath
from service.config import Settings
from service.jobs.requirements import OUR_PACKAGES, WORKER_DISTRIBUTIONS, protected
from workers.pyenv.environments import (
    Aborted,
    EnvironmentFailed,
    size_of,
    worker_versions,
)
from workers.sandbox import bubblewrap
from workers.sandbox.procs import kill_group
from workers.sandbox.rank_setup import RunAs

POLL_SECONDS = 0.1
TIMEOUT_SETTING = "DPTRAIN_ENV_BUILD_TIMEOUT_SECONDS"
SIZE_SETTING = "DPTRAIN_MAX_ENV_BYTES"
# How often the build's folder is measured while it runs: a walk of an environment's few thousand
# files costs milliseconds, and a second's writes at disk speed is the most it can overshoot by.
MEASURE_SECONDS = 1.0
# util-linux's, like setpriv: it sets RLIMIT_FSIZE and execs the installer (so its pid is the one
# started), which then cannot write any one file past the bound between two measures.
PRLIMIT = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
MESSAGE_LINES = 12
TRACEBACK_LINES = 60
# Variables pip may need from the worker's environment (a proxy to the index, the locale).
PASSED_THROUGH = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "LANG")


@dataclass(frozen=True)
class Builder:
    """How this node builds: the job's lines, the operator's settings, the ranks' sandbox and user."""

    lines: list[str]
    settings: Settings
    log: Path
    # Whether the ranks run in the sandbox (the build then does too), and who they run as
    # (workers/sandbox/rank_setup.ranks_user decided it for the attempt; None: the worker's user).
    sandboxed: bool
    run_as: RunAs | None = None
    code_dir: Path | None = None
    # Runs while the build does: False gives it up (Aborted), e.g. on a cancel.
    poll: Callable[[], bool] = lambda: True

    def __call__(self, root: Path) -> None:
        """Build the environment in the empty folder `root`; EnvironmentFailed with pip's own message."""
        _make_venv(root)
        (root / "setup").mkdir()
        (root / "setup" / "requirements.txt").write_text("\n".join(self.lines) + "\n")
        pins = [f"{name}=={v}" for name, v in worker_versions().items() if name in WORKER_DISTRIBUTIONS]
        (root / "setup" / "constraints.txt").write_text("\n".join(pins) + "\n")
        (root / "setup" / "excludes.txt").write_text("\n".join(sorted(worker_distributions())) + "\n")
        (root / "setup" / "tmp").mkdir()
        # The folder is the installer's to write: it runs as the ranks' user where the worker switches.
        owner = self._switch_to()
        if owner is not None:
            _chown_tree(root, *owner)
        try:
            rc, output = self._run(root)
        finally:
            if owner is not None:
                _chown_tree(root, os.getuid(), os.getgid())
            shutil.rmtree(root / "setup" / "tmp", ignore_errors=True)
        if rc != 0:
            raise EnvironmentFailed(_install_error(output, rc))
        if (unmet := unmet_by_worker(root, self.lines)) is not None:
            raise EnvironmentFailed(JobError(type=Failure.ENVIRONMENT_BUILD_FAILED, message=unmet))
        if (found := shadowing(root)) is not None:
            message = f"the requirements installed {found}, which always comes from the worker's environment"
            raise EnvironmentFailed(JobError(type=Failure.ENVIRONMENT_BUILD_FAILED, message=message))
        # Read-only to the ranks, whoever they run as (the worker's umask is 077); the worker alone
        # removes it.
        os.chmod(root, 0o755)
        for dirpath, dirs, files in os.walk(root):
            for name in (*dirs, *files):
                path = os.path.join(dirpath, name)
                if not os.path.islink(path):
                    os.chmod(path, os.lstat(path).st_mode & 0o755 | 0o444 | (0o111 if name in dirs else 0))

    def _argv(self, root: Path) -> list[str]:
        setup = root / "setup"
        if (uv := uv_binary()) is not None:
            argv = [uv, "pip", "install", "--python", str(root / "bin" / "python"), "--no-progress"]
            argv += ["--color", "never", "--no-cache", "-r", str(setup / "requirements.txt")]
            argv += ["--excludes", str(setup / "excludes.txt")]
        else:
            argv = [str(root / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "--no-input"]
            argv += ["install", "--no-cache-dir", "--progress-bar", "off", "--no-warn-script-location"]
            argv += ["-r", str(setup / "requirements.txt"), "-c", str(setup / "constraints.txt")]
        if self.settings.pip_index_url:
            argv += ["--index-url", self.settings.pip_index_url]
        for link in filter(None, (s.strip() for s in self.settings.pip_find_links.split(","))):
            argv += ["--find-links", link]
        if self.sandboxed:
            user = self._switch_to()
            box = bubblewrap.Box(
                workdir=self.code_dir or root,
                tmp_dir=setup / "tmp",
                # Only the environment's folder is writable; the job's code tree (a local
                # requirement's path) is read-only, as the ranks see it.
                writable=(root,),
                read_only=(self.code_dir,) if self.code_dir is not None else (),
                uid=user[0] if user else None,
                gid=user[1] if user else None,
            )
            argv = bubblewrap.bwrap_argv(box, argv)
        if PRLIMIT is None:
            return argv
        return [PRLIMIT, f"--fsize={self.settings.max_env_bytes}", "--", *argv]

    def _switch_to(self) -> tuple[int, int] | None:
        """The (uid, gid) the installer's processes switch to; None: they keep the worker's."""
        run_as = self.run_as
        return (run_as.uid, run_as.gid) if run_as is not None and run_as.switched else None

    def _check_size(self, root: Path, log: TextIO, output: list[str]) -> None:
        """EnvironmentTooLarge if the folder (the installer's temporary files included) is over its bound."""
        limit = self.settings.max_env_bytes
        size = size_of(root)
        if size <= limit:
            return
        message = (
            f"the environment's build wrote {_mib(size)} (at least), over the limit of {_mib(limit)} "
            f"({SIZE_SETTING}); the build was stopped and nothing was kept"
        )
        log.write(f"[setup] {message}\n")
        raise EnvironmentFailed(
            JobError(type=Failure.ENVIRONMENT_TOO_LARGE, message=message, traceback=_tail(output))
        )

    def _run(self, root: Path) -> tuple[int, list[str]]:  # noqa: C901 - one loop: read, log, time out
        tmp = "/tmp" if self.sandboxed else str(root / "setup" / "tmp")
        env = {k: v for k, v in os.environ.items() if k in PASSED_THROUGH}
        env |= {
            "PATH": f"{root / 'bin'}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
            "HOME": tmp,
            "TMPDIR": tmp,
            "PIP_CONFIG_FILE": os.devnull,
            "UV_NO_CONFIG": "1",
            "UV_PYTHON_DOWNLOADS": "never",
            "PYTHONNOUSERSITE": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        user: dict[str, Any] = {}
        if not self.sandboxed and (owner := self._switch_to()) is not None:
            user = {"user": owner[0], "group": owner[1], "extra_groups": []}
        deadline = time.monotonic() + self.settings.env_build_timeout_seconds
        measured = time.monotonic()
        output: list[str] = []
        # logs/ is the ranks' folder: never written through a link or a FIFO put in the log's place.
        opened = create_beneath(self.log.parent, self.log.name)
        if opened is None:
            message = f"{self.log} is a link or not a regular file: the build's output is not put there"
            raise EnvironmentFailed(JobError(type=Failure.ENVIRONMENT_BUILD_FAILED, message=message))
        with io.TextIOWrapper(opened, encoding="utf-8", errors="replace") as log:
            log.write(f"[setup] installing {len(self.lines)} requirements: {' '.join(self.lines)}\n")
            log.flush()
            proc: subprocess.Popen[bytes] = subprocess.Popen(
                self._argv(root),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.code_dir or root,
                start_new_session=True,
                **user,
            )
            assert proc.stdout is not None
            os.set_blocking(proc.stdout.fileno(), False)
            pending = b""
            try:
                while True:
                    chunk = _read(proc)
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for raw in lines:
                        line = raw.decode(errors="replace").rstrip()
                        output.append(line)
                        log.write(f"[setup] {line}\n")
                    log.flush()
                    if not chunk and proc.poll() is not None:
                        # Once more, the installer gone: what it wrote after the last measure (or
                        # up to RLIMIT_FSIZE, which killed it) counts too.
                        self._check_size(root, log, output)
                        break
                    if time.monotonic() > deadline:
                        limit = self.settings.env_build_timeout_seconds
                        message = f"the environment's build took longer than {limit:g} s ({TIMEOUT_SETTING})"
                        log.write(f"[setup] {message}\n")
                        tail = "\n".join(output[-TRACEBACK_LINES:]) or None
                        raise EnvironmentFailed(
                            JobError(type=Failure.ENVIRONMENT_BUILD_FAILED, message=message, traceback=tail)
                        )
                    if not self.poll():
                        raise Aborted
                    if time.monotonic() - measured >= MEASURE_SECONDS:
                        measured = time.monotonic()
                        self._check_size(root, log, output)
                    if not chunk:
                        time.sleep(POLL_SECONDS)
            finally:
                if proc.poll() is None:
                    kill_group(proc, sandboxed=self.sandboxed)
                with contextlib.suppress(Exception):
                    proc.wait(timeout=30)
                proc.stdout.close()
        return proc.returncode, output


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _tail(output: list[str]) -> str | None:
    return "\n".join(output[-TRACEBACK_LINES:]) or None


def _read(proc: subprocess.Popen[bytes]) -> bytes:
    assert proc.stdout is not None
    try:
        return proc.stdout.read() or b""
    except BlockingIOError:
        return b""


def uv_binary() -> str | None:
    """uv beside the worker's interpreter (where `pip install uv` puts it), else on PATH; None without."""
    return shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")


def worker_distributions() -> set[str]:
    """The canonical names of every distribution in the worker's environment (what a job sees underneath)."""
    names = (dist.metadata["Name"] for dist in importlib.metadata.distributions())
    return {canonicalize_name(name) for name in names if name}


def unmet_by_worker(root: Path, lines: list[str]) -> str | None:
    """Why the environment cannot run here: a requirement on one of the worker's packages it does not meet."""
    provided = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    wanted: list[tuple[str, str]] = [("the job's requirements", line) for line in lines]
    purelib = [str(p) for p in root.glob("lib/python*/site-packages")]
    for dist in importlib.metadata.distributions(path=purelib):
        wanted += [(f"{dist.metadata['Name']} {dist.version}", r) for r in dist.requires or []]
    for who, text in wanted:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue  # an option line of the job's (the operator allowed it); not a requirement
        have = provided.get(canonicalize_name(req.name))
        if have is None or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            met = req.specifier.contains(Version(have), prereleases=True)
        except InvalidVersion:
            met = True  # a version PEP 440 cannot order: nothing to compare it with
        if not met:
            return (
                f"{who} need {req}, but the worker provides {req.name} {have}, which a job's "
                "environment cannot replace (it is part of the worker's own stack)"
            )
    return None


def _make_venv(root: Path) -> None:
    """An empty venv at `root` with the worker's interpreter, its site-packages layered over the worker's."""
    uv = uv_binary()
    if uv is not None:
        argv = [uv, "venv", "--quiet", "--allow-existing", "--python", sys.executable, str(root)]
    else:
        argv = [sys.executable, "-m", "venv", "--without-pip", str(root)]
    env = {"PATH": os.environ.get("PATH", ""), "UV_NO_CONFIG": "1", "UV_PYTHON_DOWNLOADS": "never"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    if done.returncode != 0:
        message = f"making the environment's venv failed: {done.stderr.strip()[-2000:]}"
        raise EnvironmentFailed(JobError(type=Failure.ENVIRONMENT_BUILD_FAILED, message=message))
    layered = [Path(p) for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib,) = {p for p in root.glob("lib/python*/site-packages")}
    # After the venv's own folder (addsitedir appends), so the job's packages win over the worker's
    # others; torch, numpy and ours are never in the venv (constraints, then `shadowing`).
    lines = [f"import site; site.addsitedir({str(p)!r})" for p in layered]
    (purelib / "_dptrain_worker.pth").write_text("\n".join(lines) + "\n")


def shadowing(root: Path) -> str | None:
    """A package of the worker's (torch, numpy, ours) that the environment's own site-packages provides."""
    for purelib in root.glob("lib/python*/site-packages"):
        for entry in purelib.iterdir():
            name = entry.name
            if name.endswith(".dist-info"):
                dist = name[: -len(".dist-info")].rsplit("-", 1)[0]
                if protected(dist):
                    return repr(dist)
                continue
            module = name.split(".", 1)[0]
            if module in OUR_PACKAGES or module in WORKER_DISTRIBUTIONS or module.startswith("dptrain"):
                return repr(module)
    return None


def _install_error(output: list[str], rc: int) -> JobError:
    """The job's error for a failed install: the resolver's own words (uv's, or pip's ERROR lines)."""
    said = [line for line in output if line.startswith("ERROR:")]
    if not said:
        # uv: `error: ...` or `  × No solution found ...` then its explanation, indented.
        start = next((i for i, line in enumerate(output) if line.lstrip().startswith(("error:", "×"))), None)
        said = [line.strip() for line in output[start:] if line.strip()] if start is not None else []
    message = "\n".join(said[:MESSAGE_LINES]) or f"the installer exited with code {rc}"
    tail = "\n".join(output[-TRACEBACK_LINES:]) or None
    return JobError(
        type=Failure.ENVIRONMENT_BUILD_FAILED,
        message=f"installing the job's requirements failed: {message}",
        traceback=tail,
    )


def _chown_tree(top: Path, uid: int, gid: int) -> None:
    for dirpath, dirs, files in os.walk(top):
        for name in (*dirs, *files):
            with contextlib.suppress(FileNotFoundError):
                os.lchown(os.path.join(dirpath, name), uid, gid)
    os.chown(top, uid, gid)
