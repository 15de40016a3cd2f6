"""`submit --workdir` says what the ignore rules left out, and `--include` takes it (issue 31, finding 2).

The tree is nanoGPT's shape: its `.gitignore` keeps the prepared data (`*.bin`, `*.pkl`) out of git,
which once left it out of the job too, with nothing said, and the job failed with FileNotFoundError.
"""

from __future__ import annotations

import random
import tarfile
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from rich.filesize import decimal

from dptrain.client import Client
from dptrain.errors import DataLeftOut
from tests.cli.conftest import dptrain, flat
from tests.conftest import job_spec

DATA = {"train.bin": 3000, "val.bin": 700, "meta.pkl": 120}


def nanogpt(root: Path) -> Path:
    """A nanoGPT-like working directory with its prepared data, ignored by its .gitignore."""
    shakespeare = root / "data" / "shakespeare_char"
    shakespeare.mkdir(parents=True)
    (root / ".gitignore").write_text(".DS_Store\n__pycache__/\n*.bin\n*.pkl\n*.pt\n*.pyc\nenv/\n")
    for name in ("train.py", "model.py"):
        (root / name).write_text("print('hi')\n")
    (shakespeare / "prepare.py").write_text("print('prepare')\n")
    for name, size in DATA.items():
        (shakespeare / name).write_bytes(bytes(size))
    (root / ".DS_Store").write_bytes(b"x" * 10)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/master\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    return root


def archived(api: TestClient, job_id: str, tmp_path: Path) -> list[str]:
    """The file names of the code archive job `job_id` runs."""
    sha = api.get(f"/v1/jobs/{job_id}").json()["spec"]["code"]["sha256"]
    client = Client("http://testserver", token=None)
    client.http = api
    client.download_code(sha, tmp_path / "got.tar.gz")
    with tarfile.open(tmp_path / "got.tar.gz") as tar:
        return sorted(m.name for m in tar.getmembers() if m.isfile())


def test_ignored_data_is_listed_with_its_total_and_include_uploads_it(
    api: TestClient, spec_file: Callable[..., Path], tmp_path: Path
) -> None:
    work = nanogpt(tmp_path / "nanoGPT")
    spec = spec_file(recipe=None, command=["python", "train.py"])
    r = dptrain("submit", spec, "--workdir", work)
    assert r.exit_code == 0, r.output
    said = flat(r.stderr)
    listed = [f"data/shakespeare_char/{name}" for name in DATA]
    assert f"looks like data or weights: 3 files, {decimal(sum(DATA.values()))}" in said, r.stderr
    assert all(path in said for path in listed), r.stderr
    assert said.index(listed[0]) < said.index(listed[1]) < said.index(listed[2]), "biggest first"
    assert "--include '*.bin' --include '*.pkl'" in said, "the option that takes them is spelled out"
    assert f"other: 1 file, {decimal(10)} (.DS_Store)" in said, r.stderr
    assert "never packed (version control, environments, caches): .git/, __pycache__/" in said, r.stderr
    assert archived(api, r.stdout.strip(), tmp_path) == [
        ".gitignore", "data/shakespeare_char/prepare.py", "model.py", "train.py"
    ]  # fmt: skip

    r = dptrain("submit", spec, "--workdir", work, "--include", "*.bin", "--include", "data/**/meta.pkl")
    assert r.exit_code == 0, r.output
    said = flat(r.stderr)
    assert f"taken by --include: 3 files, {decimal(sum(DATA.values()))}" in said, r.stderr
    assert "looks like data" not in said and "other: 1 file" in said, r.stderr
    assert set(listed) <= set(archived(api, r.stdout.strip(), tmp_path)), "the data travels with the code"


def test_include_reaches_into_an_ignored_directory_and_warns_of_a_pattern_that_took_nothing(
    api: TestClient, spec_file: Callable[..., Path], tmp_path: Path
) -> None:
    work = nanogpt(tmp_path / "nanoGPT")
    (work / ".dptrainignore").write_text("data/\n")
    spec = spec_file(recipe=None, command=["python", "train.py"])
    r = dptrain("submit", spec, "--workdir", work, "--include", "data/", "--include", "*.ckpt")
    assert r.exit_code == 0, r.output
    said = flat(r.stderr)
    assert "taken by --include: 4 files" in said, r.stderr
    assert "warning: --include '*.ckpt' took nothing" in said, r.stderr
    assert "data/shakespeare_char/prepare.py" in archived(api, r.stdout.strip(), tmp_path)


def test_include_is_refused_without_workdir_or_with_a_bad_pattern(
    served: Callable[..., list[str]], spec_file: Callable[..., Path], tmp_path: Path
) -> None:
    calls = served({})
    spec = spec_file(recipe=None, command=["python", "train.py"])
    r = dptrain("submit", spec, "--include", "*.bin")
    assert r.exit_code == 2 and "--include needs --workdir" in flat(r.output), r.output
    r = dptrain("submit", spec, "--workdir", nanogpt(tmp_path / "w"), "--include", "!")
    assert r.exit_code == 2 and "--include" in flat(r.output), r.output
    assert calls == [], "nothing is sent"


def test_what_include_takes_counts_against_the_size_limit(
    served: Callable[..., list[str]], spec_file: Callable[..., Path], tmp_path: Path
) -> None:
    calls = served({})
    work = nanogpt(tmp_path / "nanoGPT")
    (work / "data" / "shakespeare_char" / "train.bin").write_bytes(random.Random(0).randbytes(4096))
    spec = spec_file(recipe=None, command=["python", "train.py"])
    r = dptrain("submit", spec, "--workdir", work, "--include", "*.bin", "--max-code-bytes", "1000")
    assert r.exit_code == 3 and calls == [], r.output
    said = flat(r.stderr)
    assert "over --max-code-bytes 1000" in said and "of them taken by --include: 2 files" in said, r.stderr


def test_the_sdk_takes_include_patterns_and_warns_of_data_left_out(api: TestClient, tmp_path: Path) -> None:
    work = nanogpt(tmp_path / "nanoGPT")
    client = Client("http://testserver", token=None)
    client.http = api
    spec = job_spec(recipe=None, command=["python", "train.py"])
    with pytest.warns(DataLeftOut, match=r"3 files .* look like data or weights.*'\*\.bin', '\*\.pkl'"):
        client.submit(spec, workdir=work)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job = client.submit(spec, workdir=work, include=["*.bin", "*.pkl"])
    assert "data/shakespeare_char/train.bin" in archived(api, job.id, tmp_path)
    upload = client.upload_code(work)
    assert upload.left_out.data.count == 3 and upload.left_out.data.bytes == sum(DATA.values())
