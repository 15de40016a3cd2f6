"""A job's outputs measured and hashed as the runner does: regular files only, no link followed, capped."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from api_schemas import JobError
from workers.attempt.end import is_retryable
from workers.attempt.outputs import Guard, Limits, measure, sha256_of

ROOMY = Limits(max_bytes=1 << 20, max_files=100)


@pytest.fixture
def outputs(tmp_path: Path) -> Path:
    """An outputs folder as a hostile script might leave it, beside a secret of the worker's."""
    out = tmp_path / "outputs"
    (out / "sub" / "deeper").mkdir(parents=True)
    (out / "ckpt.pt").write_bytes(b"x" * 1000)
    (out / "sub" / "deeper" / "log.txt").write_bytes(b"hello")
    secret = tmp_path / "token"
    secret.write_text("worker secret")
    (out / "stolen").symlink_to(secret)
    (out / "elsewhere").symlink_to(tmp_path)
    os.mkfifo(out / "pipe")
    return out


def test_only_regular_files_count_with_their_relative_paths_and_sizes(outputs: Path) -> None:
    found = measure(outputs, ROOMY)
    assert sorted(found.files) == [("ckpt.pt", 1000), ("sub/deeper/log.txt", 5)]
    assert found.total_bytes == 1005 and found.over is None
    assert sorted(found.skipped) == [
        "elsewhere (a symlink, never followed)",
        "pipe (not a regular file)",
        "stolen (a symlink, never followed)",
    ]


def test_a_file_is_hashed_only_through_real_folders(outputs: Path, tmp_path: Path) -> None:
    assert sha256_of(outputs, "ckpt.pt") == (1000, hashlib.sha256(b"x" * 1000).hexdigest())
    assert sha256_of(outputs, "stolen") is None, "a link to a secret is never read"
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "log.txt").write_text("not the job's")
    (outputs / "sub" / "deeper" / "log.txt").unlink()
    (outputs / "sub" / "deeper").rmdir()
    (outputs / "sub" / "deeper").symlink_to(tmp_path / "outside")
    assert sha256_of(outputs, "sub/deeper/log.txt") is None, "nor a file behind a linked folder"
    for bad in ("../token", "/etc/passwd", "sub//x", "", "pipe"):
        assert sha256_of(outputs, bad) is None, bad


def test_over_the_byte_limit_names_the_size_and_the_limit(outputs: Path) -> None:
    found = measure(outputs, Limits(max_bytes=999, max_files=100))
    assert found.over is not None
    assert "1000 bytes" in found.over and "999 bytes" in found.over, found.over
    assert "DPTRAIN_MAX_OUTPUT_BYTES_PER_JOB" in found.over


def test_over_the_file_limit_says_so(outputs: Path) -> None:
    found = measure(outputs, Limits(max_bytes=1 << 20, max_files=1))
    assert found.over is not None and "more than 1 files" in found.over, found.over
    assert "DPTRAIN_MAX_OUTPUT_FILES_PER_JOB" in found.over


def test_links_and_folders_count_against_the_file_limit(tmp_path: Path) -> None:
    out = tmp_path / "outputs"
    out.mkdir()
    for i in range(20):
        (out / f"link-{i}").symlink_to("/etc/hostname")
        (out / f"dir-{i}").mkdir()
    found = measure(out, Limits(max_bytes=1 << 20, max_files=30))
    assert found.files == [] and found.over is not None, "no regular file, yet 40 names to walk"


def test_a_missing_folder_holds_nothing(tmp_path: Path) -> None:
    found = measure(tmp_path / "none", ROOMY)
    assert found.files == [] and found.over is None


def test_the_guard_measures_when_due_and_stays_over(outputs: Path) -> None:
    now = [0.0]
    guard = Guard(outputs, Limits(max_bytes=2000, max_files=100), every=5.0, clock=lambda: now[0])
    (outputs / "big").write_bytes(b"y" * 2000)
    assert not guard.over(), "not measured before its interval"
    now[0] = 5.0
    assert guard.over()
    assert guard.error is not None and guard.error.type == "OutputTooLarge"
    (outputs / "big").unlink()
    assert guard.over(), "once over, the attempt stops whatever the folder holds next"


def test_output_too_large_is_not_retried() -> None:
    assert not is_retryable(JobError(type="OutputTooLarge", message="over"))


def test_an_unreadable_folder_is_said_not_silently_dropped(
    outputs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tests run as root, which reads every folder: refuse the listing as a chmod 000 would.
    scandir = os.scandir

    def refusing(path: Any = ".") -> Any:
        if Path(path) == outputs / "sub":
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    found = measure(outputs, ROOMY)
    assert "sub/ (unreadable)" in found.skipped, found.skipped
    assert [path for path, _ in found.files] == ["ckpt.pt"]
