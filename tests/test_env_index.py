"""The test package index itself: uv and pip install from it, it counts what it serves, and down is down."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from uv import find_uv_bin

from tests.env_index import ALPHA, ALPHA_VERSIONS, BETA, BETA_VERSION, MISSING, PackageIndex

pytestmark = pytest.mark.e2e

# Generous: an install from a local index takes a second or two; one that hangs must not hang the run.
INSTALL_TIMEOUT_S = 120


def _uv_install(
    python: Path, requirement: str, *, index: PackageIndex, cache: Path, retries: int = 3
) -> subprocess.CompletedProcess[str]:
    # Its own cache: a wheel uv cached earlier would be installed without asking the index.
    env = {"UV_CACHE_DIR": str(cache), "UV_NO_CONFIG": "1", "UV_PYTHON_DOWNLOADS": "never"}
    env |= {"UV_HTTP_RETRIES": str(retries), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [find_uv_bin(), "pip", "install", "--python", str(python), "--index-url", index.url, requirement],
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=60)
    return path / "bin" / "python"


def _imported(python: Path, expression: str) -> str:
    return subprocess.run(
        [str(python), "-c", f"print({expression})"], check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()


def test_uv_installs_a_package_and_its_dependency_from_the_index(
    package_index: PackageIndex, tmp_path: Path
) -> None:
    python = _venv(tmp_path / "venv")
    before = package_index.requests(BETA), package_index.requests(ALPHA)

    done = _uv_install(python, BETA, index=package_index, cache=tmp_path)

    assert done.returncode == 0, done.stderr
    # dpt-beta needs dpt-alpha>=1: the resolver took the newest the index has.
    versions = _imported(python, "__import__('dpt_beta').VERSION, __import__('dpt_beta').ALPHA_VERSION")
    assert versions == f"{BETA_VERSION} {ALPHA_VERSIONS[-1]}"
    assert package_index.requests(BETA) > before[0]
    assert package_index.requests(ALPHA.replace("-", "_")) > before[1]  # any spelling of the name


def test_pip_installs_a_pinned_older_version(package_index: PackageIndex, tmp_path: Path) -> None:
    python = _venv(tmp_path / "venv")
    pin = f"{ALPHA}=={ALPHA_VERSIONS[0]}"

    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-cache-dir", "--quiet"]
        + ["--disable-pip-version-check", "--index-url", package_index.url, pin],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )

    assert done.returncode == 0, done.stderr
    assert _imported(python, "__import__('dpt_alpha').VERSION") == ALPHA_VERSIONS[0]


def test_a_missing_project_fails_with_the_resolvers_message(
    package_index: PackageIndex, tmp_path: Path
) -> None:
    python = _venv(tmp_path / "venv")

    done = _uv_install(python, MISSING, index=package_index, cache=tmp_path)

    assert done.returncode != 0
    assert MISSING in done.stderr
    assert package_index.requests(MISSING) >= 1  # asked, answered 404: no fallback to pypi.org


def test_an_install_fails_while_the_index_is_down_and_works_once_it_is_back(
    package_index: PackageIndex, tmp_path: Path
) -> None:
    python = _venv(tmp_path / "venv")
    served = package_index.requests(ALPHA)
    package_index.stop()
    try:
        # Refused connections end the install; without retries (uv's default backs off ~10 s) at once.
        down = _uv_install(python, ALPHA, index=package_index, cache=tmp_path / "down", retries=0)
        assert down.returncode != 0
        assert "Connection refused" in down.stderr, down.stderr
        assert package_index.requests(ALPHA) == served
    finally:
        package_index.start()

    up = _uv_install(python, ALPHA, index=package_index, cache=tmp_path / "up")
    assert up.returncode == 0, up.stderr
    assert package_index.requests(ALPHA) > served
