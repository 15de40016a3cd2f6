"""The distribution as built: the image carries every package, the client's dependencies stay light."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_image_copies_every_package_the_distribution_holds() -> None:
    included = PROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in included}
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "Dockerfile").read_text(), flags=re.M))
    assert packages == copied, f"Dockerfile COPY lines {sorted(copied)} != packages {sorted(packages)}"


def test_the_plain_install_is_the_client_alone() -> None:
    names = {re.split(r"[<>=\[;]", d)[0].strip().lower() for d in PROJECT["project"]["dependencies"]}
    assert names == {"pydantic", "httpx", "typer", "rich", "pyyaml", "pathspec"}, names
    assert set(PROJECT["project"]["optional-dependencies"]) >= {"server", "worker", "all"}
