"""An archive over the server's DPTRAIN_CODE_MAX_BYTES: refused (exit 3) with the paths that made it big."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dptrain.client import Client
from tests.cli.conftest import dptrain, flat


@pytest.fixture
def sqlite_settings() -> dict[str, Any]:
    return {"code_max_bytes": 1024}


def test_an_archive_over_the_limit_exits_3_listing_the_largest_paths(
    api: TestClient, spec_file: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_upload(*_: Any) -> bool:
        raise AssertionError("the CLI must refuse before uploading: HEAD told it the server's limit")

    monkeypatch.setattr(Client, "upload_archive", no_upload)
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "train.py").write_text("print('hello')\n")
    (work / "data" / "noise.bin").write_bytes(random.Random(0).randbytes(4096))  # gzip cannot shrink it
    r = dptrain("submit", spec_file(recipe=None, command=["python", "train.py"]), "--workdir", work)
    assert r.exit_code == 3, r.output
    said = flat(r.stderr)
    assert "DPTRAIN_CODE_MAX_BYTES" in said and "1024" in said, f"the server's limit is named: {r.stderr}"
    assert said.index("data/noise.bin") < said.index("train.py"), "the largest path comes first"
    assert ".dptrainignore" in said and r.stdout == "", r.output
    assert api.get("/v1/jobs").json()["items"] == [], "nothing is submitted after a refused upload"


def test_what_include_takes_counts_against_the_servers_limit(
    api: TestClient, spec_file: Callable[..., Path], tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print('hello')\n")
    (work / ".gitignore").write_text("*.bin\n")
    (work / "noise.bin").write_bytes(random.Random(0).randbytes(4096))
    spec = spec_file(recipe=None, command=["python", "train.py"])
    left_out = dptrain("submit", spec, "--workdir", work)
    assert left_out.exit_code == 0 and "noise.bin" in flat(left_out.stderr), left_out.output
    taken = dptrain("submit", spec, "--workdir", work, "--include", "*.bin")
    assert taken.exit_code == 3, taken.output
    said = flat(taken.stderr)
    assert "DPTRAIN_CODE_MAX_BYTES" in said and "of them taken by --include: 1 file" in said, taken.stderr
