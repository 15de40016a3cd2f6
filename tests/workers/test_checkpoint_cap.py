"""How a job's checkpoint folder is measured against DPTRAIN_MAX_CHECKPOINT_BYTES_PER_JOB (no processes)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from api_schemas import JobError
from workers.attempt.checkpoint_cap import CheckpointGuard, measure, over_cap
from workers.attempt.end import is_retryable

MIB = 1 << 20
FALLOC_FL_KEEP_SIZE = 1  # linux/falloc.h


def test_everything_in_the_folder_counts_and_no_link_is_followed(tmp_path: Path) -> None:
    (tmp_path / "ckpt-000000001.pt").write_bytes(b"x" * MIB)
    (tmp_path / ".ckpt-000000002.pt.tmp-7").write_bytes(b"x" * MIB)  # a save cut short
    (tmp_path / "junk" / "deeper").mkdir(parents=True)
    with open(tmp_path / "junk" / "deeper" / "sparse", "wb") as f:
        f.truncate(8 * MIB)  # no block on disk: its size is what a copy or a download costs
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_bytes(b"y" * 4 * MIB)
    (tmp_path / "link").symlink_to(outside)
    held = measure(tmp_path, cap=1 << 40)
    assert 10 * MIB <= held < 10 * MIB + 64 * 1024, f"expected 10 MiB and the folders' own bytes, got {held}"


def test_blocks_held_past_the_size_count(tmp_path: Path) -> None:
    # `fallocate --keep-size` takes disk without growing the size: its blocks count.
    reserved = tmp_path / "reserved"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    fd = os.open(reserved, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        assert libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, 4 * MIB) == 0, os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    assert reserved.stat().st_size == 0 and reserved.stat().st_blocks * 512 >= 4 * MIB, (
        "the disk was reserved"
    )
    assert measure(tmp_path, cap=1 << 40) >= 4 * MIB, "the reserved blocks count"


def test_over_the_cap_names_the_size_and_the_cap(tmp_path: Path) -> None:
    with open(tmp_path / "junk", "wb") as f:
        f.truncate(200 * MIB)
    error = over_cap(tmp_path, cap=64 * MIB)
    assert error is not None and error.type == "CheckpointTooLarge", error
    assert "200.0 MiB" in error.message and "over the 64.0 MiB (67108864 bytes) cap" in error.message, error
    assert "DPTRAIN_MAX_CHECKPOINT_BYTES_PER_JOB" in error.message, error.message
    assert over_cap(tmp_path, cap=200 * MIB) is None, "at the cap is not over it"


def test_the_guard_measures_when_due_and_stays_over(tmp_path: Path) -> None:
    now = [0.0]
    guard = CheckpointGuard(tmp_path, cap=2000, every=5.0, clock=lambda: now[0])
    (tmp_path / "big").write_bytes(b"y" * 2001)
    assert not guard.over(), "not measured before its interval"
    now[0] = 5.0
    assert guard.over() and guard.error is not None and guard.error.type == "CheckpointTooLarge"
    (tmp_path / "big").unlink()
    assert guard.over() and guard.at_end() is not None, "once over, the attempt fails whatever comes next"


def test_checkpoint_too_large_is_not_retried() -> None:
    assert not is_retryable(JobError(type="CheckpointTooLarge", message="over"))
