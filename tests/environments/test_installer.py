"""The installer's judgements: a requirement the worker's own stack does not meet; the resolver's words."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from workers.pyenv.build import _install_error, unmet_by_worker, worker_distributions


def _installed(root: Path, name: str, requires: list[str]) -> None:
    """A distribution `name` 1.0 in the environment's own site-packages, requiring `requires`."""
    info = root / "lib" / "python3.11" / "site-packages" / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        "Version: 1.0",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_the_worker_distributions_are_what_the_environment_sees_underneath() -> None:
    names = worker_distributions()
    assert {"torch", "numpy", "pydantic"} <= names


def test_a_dependency_the_worker_meets_passes_and_one_it_does_not_is_named(tmp_path: Path) -> None:
    numpy = importlib.metadata.version("numpy")
    _installed(tmp_path, "fits", [f"numpy>={numpy}", "pydantic>=2", "torch; extra == 'gpu'"])
    assert unmet_by_worker(tmp_path, ["fits"]) is None
    _installed(tmp_path, "old-one", ["numpy<1"])
    unmet = unmet_by_worker(tmp_path, ["fits", "old-one"])
    assert unmet is not None and "old-one 1.0 need numpy<1" in unmet and f"numpy {numpy}" in unmet, unmet


def test_a_job_line_on_a_worker_package_must_be_met_too(tmp_path: Path) -> None:
    unmet = unmet_by_worker(tmp_path, ["pydantic<1"])
    assert unmet is not None and unmet.startswith("the job's requirements need pydantic<1"), unmet
    assert unmet_by_worker(tmp_path, ["--index-url https://example.org/simple", "pydantic>=2"]) is None


def test_the_resolvers_words_are_the_message() -> None:
    uv = [
        "Using Python 3.11.7 environment at: /envs/x",
        "  × No solution found when resolving dependencies:",
        "  ╰─▶ Because dpt-missing was not found in the package registry and you require dpt-missing, we",
        "      can conclude that your requirements are unsatisfiable.",
    ]
    error = _install_error(uv, 1)
    assert error.type == "EnvironmentBuildFailed"
    assert "No solution found" in error.message and "dpt-missing was not found" in error.message, error
    pip = ["Collecting x", "ERROR: No matching distribution found for dpt-missing"]
    assert _install_error(pip, 1).message.endswith("ERROR: No matching distribution found for dpt-missing")
    assert "exited with code 2" in _install_error([], 2).message
