"""`dptrain submit --workdir`: the tree is packed, uploaded when the server lacks it, refused when too big."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from dptrain.client import Client
from tests.api_fixtures import as_user
from tests.cli.conftest import dptrain, flat, use_http


def tree(root: Path) -> Path:
    """A working directory with a script and one big data file."""
    root.mkdir()
    (root / "train.py").write_text("print('hello')\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(bytes(range(256)) * 400)
    return root


Served = Callable[[dict[str, httpx.Response]], list[str]]


def test_max_code_bytes_refuses_before_anything_is_sent(
    served: Served, spec_file: Callable[..., Path], tmp_path: Path
) -> None:
    calls = served({})
    work = tree(tmp_path / "work")
    spec = spec_file(recipe=None, command=["python", "train.py"])
    r = dptrain("submit", spec, "--workdir", work, "--max-code-bytes", "100")
    assert r.exit_code == 3 and calls == [], r.output
    said = flat(r.stderr)
    assert "over --max-code-bytes 100" in said and "data/big.bin" in said, r.stderr


def test_the_same_tree_is_uploaded_once_and_both_jobs_run_it(
    api: TestClient, spec_file: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    puts: list[str] = []
    upload = Client.upload_archive

    def counted(self: Client, sha256: str, path: Path) -> bool:
        puts.append(sha256)
        return upload(self, sha256, path)

    monkeypatch.setattr(Client, "upload_archive", counted)
    work = tree(tmp_path / "work")
    (work / "outside").symlink_to(tmp_path)
    spec = spec_file(recipe=None, command=["python", "train.py"], code={"sha256": "0" * 64})
    first, second = (dptrain("submit", spec, "--workdir", work) for _ in range(2))
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    assert "code uploaded" in first.stderr and "code already on the server" in second.stderr, second.stderr
    assert "warning: skipped outside" in flat(first.stderr), "a symlink out of the tree is named"
    jobs = [api.get(f"/v1/jobs/{r.stdout.strip()}").json() for r in (first, second)]
    (sha,) = {j["spec"]["code"]["sha256"] for j in jobs}
    assert puts == [sha], f"one upload for two submits of one tree: {puts}"
    assert first.stderr.startswith(f"code {sha[:12]} "), first.stderr
    got = tmp_path / "got.tar.gz"
    client = Client("http://testserver", token=None)
    client.http = api
    client.download_code(sha, got)
    with tarfile.open(got) as tar:
        assert sorted(tar.getnames()) == ["data", "data/big.bin", "train.py"], tar.getnames()


def test_a_user_who_may_not_run_code_is_refused_with_exit_3(
    api: TestClient, spec_file: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = api.post("/v1/users", json={"name": "intern"}).json()["token"]
    use_http(monkeypatch, TestClient(api.app, headers=as_user(token)))
    spec = spec_file(recipe=None, command=["python", "train.py"])
    r = dptrain("submit", spec, "--workdir", tree(tmp_path / "work"))
    assert r.exit_code == 3 and "refused (403)" in flat(r.stderr), r.output
    assert api.get("/v1/jobs").json()["items"] == [] and r.stdout == ""
