"""A real package index for the environment tests, with no internet: pypiserver on 127.0.0.1.

The wheels are built at session start from the tiny packages in tests/fixtures/env_packages (two
versions of dpt-alpha, and dpt-beta, which depends on dpt-alpha), offline and without build isolation
(the venv's setuptools builds them); dpt-bloat is served as a source distribution whose build
writes 64 MiB and hangs (SDIST_ONLY). `package_index` serves them; `requests(name)` counts what the
index really served for a project, read from pypiserver's own request log, so a test can tell a
cache hit (no request) from a build. `stop()` and `start()` take the index down and bring it back on
the same URL. Test modules that use it start processes: they carry the e2e marker.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from uv import find_uv_bin

from tests.conftest import free_port

SOURCES = Path(__file__).resolve().parent / "fixtures" / "env_packages"
ALPHA = "dpt-alpha"  # two versions, each module `dpt_alpha` with VERSION = its version
ALPHA_VERSIONS = ("1.0", "2.0")
BETA = "dpt-beta"  # module `dpt_beta`: VERSION, and ALPHA_VERSION (the dpt-alpha it imported)
BETA_VERSION = "1.0"  # requires dpt-alpha>=1
# A project the index does not have: its install must fail with the resolver's message.
MISSING = "dpt-missing"
# A source distribution only: its build writes 64 MiB in 1 MiB files, then hangs (an environment
# build over DPTRAIN_MAX_ENV_BYTES, stopped while it runs).
BLOAT = "dpt-bloat"
SDIST_ONLY = frozenset({BLOAT})

START_TIMEOUT_S = 30.0
_MARK = "dpt-index-request"
_REQUEST = re.compile(rf"{_MARK} (?P<method>[A-Z]+) (?P<path>\S+)")


def build_wheels(out: Path, work: Path) -> list[Path]:
    """Build every package in SOURCES into `out` with uv, offline; sources are copied to `work` first.

    Copied because a setuptools build writes build/ and *.egg-info next to its sources. Those in
    SDIST_ONLY are packed as source distributions instead, built by whoever installs them.
    """
    out.mkdir(parents=True, exist_ok=True)
    for source in sorted(p for p in SOURCES.iterdir() if (p / "pyproject.toml").exists()):
        name, version = source.name.rsplit("-", 1)
        if name in SDIST_ONLY:
            _pack_sdist(source, out, name=name, version=version)
            continue
        copy = work / source.name
        shutil.copytree(source, copy)
        subprocess.run(
            [find_uv_bin(), "build", "--offline", "--no-config", "--wheel", "--no-build-isolation"]
            + ["--python", sys.executable, "--out-dir", str(out), str(copy)],
            check=True,
            capture_output=True,
            env={"UV_CACHE_DIR": str(work / "uv-cache"), "PATH": "/usr/bin:/bin"},
            timeout=120,
        )
    return sorted(out.glob("*.whl"))


def _pack_sdist(source: Path, out: Path, *, name: str, version: str) -> Path:
    """`source` as the source distribution `<name>-<version>.tar.gz` (PEP 625), packed by hand.

    By hand: building it with its own backend would run that backend's wheel build's behaviour.
    """
    top = f"{name.replace('-', '_')}-{version}"
    path = out / f"{top}.tar.gz"
    pkg_info = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    with tarfile.open(path, "w:gz") as tar:
        for file in sorted(source.iterdir()):
            if file.is_file():
                tar.add(file, arcname=f"{top}/{file.name}")
        info = tarfile.TarInfo(f"{top}/PKG-INFO")
        info.size = len(pkg_info)
        tar.addfile(info, io.BytesIO(pkg_info))
    return path


def _project(path: str) -> str | None:
    """The project a request path is about (PEP 503 normalised), or None for the index's other pages."""
    parts = [p for p in path.split("/") if p]
    if len(parts) == 2 and parts[0] == "simple":
        return canonicalize_name(parts[1])
    if len(parts) == 2 and parts[0] == "packages":
        try:
            if parts[1].endswith(".whl"):
                return str(parse_wheel_filename(parts[1])[0])
            return str(parse_sdist_filename(parts[1])[0])
        except ValueError:
            return None
    return None


class PackageIndex:
    """pypiserver serving `wheelhouse` on 127.0.0.1:`port`; its request log is kept across restarts."""

    def __init__(self, *, wheelhouse: Path, log: Path, port: int) -> None:
        self.wheelhouse = wheelhouse  # also usable as a --find-links wheelhouse (offline clusters)
        self.log = log
        self.port = port
        self.url = f"http://127.0.0.1:{port}/simple/"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        """Whether the server process is up."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the server (again) on the same port and wait until it answers."""
        if self.running:
            return
        self._process = subprocess.Popen(
            [sys.executable, "-m", "pypiserver", "run", "--host", "127.0.0.1", "--port", str(self.port)]
            # Never redirect a missing project to pypi.org: the tests have no internet, and a
            # missing requirement must fail at once with the resolver's message.
            + ["--disable-fallback", "--server", "wsgiref", "-v", "--log-stream", "none"]
            + ["--log-file", str(self.log), "--log-req-frmt", f"{_MARK} %(REQUEST_METHOD)s %(PATH_INFO)s"]
            + [str(self.wheelhouse)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"pypiserver exited with {self._process.returncode}:\n{self._log_text()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"pypiserver did not answer within {START_TIMEOUT_S}s:\n{self._log_text()}")

    def stop(self) -> None:
        """Stop the server: connections to `url` are refused until `start()`."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def requests(self, name: str | None = None) -> int:
        """How many requests the index has answered for project `name` (any name form), since it was built.

        Index pages and file downloads both count, 404s too; with no name, every request about any
        project. Cumulative over restarts: compare before and after.
        """
        wanted = canonicalize_name(name) if name is not None else None
        count = 0
        for match in _REQUEST.finditer(self._log_text()):
            project = _project(match["path"])
            if project is not None and (wanted is None or project == wanted):
                count += 1
        return count

    def _log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


@contextmanager
def running_index(base: Path) -> Iterator[PackageIndex]:
    """Build the wheels under `base` and serve them until the block ends (the benchmarks use it too)."""
    wheelhouse = base / "wheels"
    build_wheels(wheelhouse, base / "build")
    index = PackageIndex(wheelhouse=wheelhouse, log=base / "requests.log", port=free_port())
    index.start()
    try:
        yield index
    finally:
        index.stop()


@pytest.fixture(scope="session")
def package_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PackageIndex]:
    """A running local index serving dpt-alpha 1.0 and 2.0 and dpt-beta 1.0 (see module constants)."""
    with running_index(tmp_path_factory.mktemp("package_index")) as index:
        yield index
