"""A job's outputs (DPTRAIN_OUTPUT_DIR): measured while its ranks run, recorded as artifacts after.

The directory is written by user code, so nothing in it is trusted: only regular files count, no
symlink is ever followed (one may point at the worker's secrets), names that are not UTF-8 are left
out, and every file is opened with no link followed on its way (service.files.open_beneath). What
is left out is said in the job's timeline.
The limits (DPTRAIN_MAX_OUTPUT_BYTES_PER_JOB, DPTRAIN_MAX_OUTPUT_FILES_PER_JOB) are checked every
few seconds while the ranks run and again at the attempt's end; past either the job fails with
OutputTooLarge, which a restart would only meet again (rank_contract/failures.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError
from rank_contract.failures import Failure
from service.files import open_beneath
from service.jobs import artifacts_repository, lifecycle
from service.jobs.artifacts_repository import ArtifactRow
from workers.attempt.periodic_check import PeriodicCheck

log = logging.getLogger(__name__)

# How often a running job's outputs are measured: a walk of at most the file limit's lstat calls.
CHECK_SECONDS = 5.0
CHUNK_BYTES = 1 << 20
# How many left-out paths the timeline names (their count is always given).
NAMED_SKIPS = 5


@dataclass(frozen=True)
class Limits:
    """The most a job's outputs may hold: bytes and regular files."""

    max_bytes: int
    max_files: int


@dataclass
class Found:
    """What a walk of the outputs found: regular files (relative path, size) and what it left out."""

    files: list[tuple[str, int]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    total_bytes: int = 0
    # Every name the walk met (files, folders, links...): what the file limit bounds, so that a
    # million empty folders or links cost no more to walk than a million files.
    entries: int = 0
    over: str | None = None


def size_text(n: int) -> str:
    """`n` bytes as a person reads them, with the exact count: `2.0 KiB (2048 bytes)`."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def measure(directory: Path, limits: Limits) -> Found:
    """Walk `directory` without following links; stops early once it is over `limits` (`over` says how)."""
    found = Found()

    def unreadable(exc: OSError) -> None:
        # A folder the job made unreadable: said, not silently left out (the top one missing is fine).
        if exc.filename is not None and Path(exc.filename) != directory:
            found.skipped.append(f"{_shown(_relative(Path(exc.filename), directory))}/ (unreadable)")

    for root, dirs, files in os.walk(directory, onerror=unreadable, followlinks=False):
        base = Path(root)
        found.entries += len(dirs) + len(files)
        if (over := _over(found, limits)) is not None:
            found.over = over
            return found
        for name in sorted(dirs):
            # os.walk lists a link to a folder among the folders and does not descend into it.
            if (base / name).is_symlink():
                rel = _shown(_relative(base / name, directory))
                found.skipped.append(f"{rel} (a symlink, never followed)")
        dirs.sort()
        for name in sorted(files):
            path = base / name
            rel = _relative(path, directory)
            try:
                info = path.lstat()
            except OSError:
                continue  # gone since the listing
            if stat.S_ISLNK(info.st_mode):
                found.skipped.append(f"{_shown(rel)} (a symlink, never followed)")
            elif not stat.S_ISREG(info.st_mode):
                found.skipped.append(f"{_shown(rel)} (not a regular file)")
            elif not _utf8(rel):
                found.skipped.append(f"{_shown(rel)} (not a UTF-8 name)")
            else:
                found.files.append((rel, info.st_size))
                found.total_bytes += info.st_size
                found.over = _over(found, limits)
                if found.over is not None:
                    return found
    return found


def _over(found: Found, limits: Limits) -> str | None:
    if found.total_bytes > limits.max_bytes:
        return (
            f"the job's outputs (DPTRAIN_OUTPUT_DIR) hold at least {size_text(found.total_bytes)}, "
            f"over the limit of {size_text(limits.max_bytes)} (DPTRAIN_MAX_OUTPUT_BYTES_PER_JOB)"
        )
    if found.entries > limits.max_files:
        return (
            f"the job's outputs (DPTRAIN_OUTPUT_DIR) hold more than {limits.max_files} files, folders "
            "and links, over the limit (DPTRAIN_MAX_OUTPUT_FILES_PER_JOB)"
        )
    return None


def _relative(path: Path, directory: Path) -> str:
    return path.relative_to(directory).as_posix()


def _shown(name: str) -> str:
    """`name` fit for the timeline: undecodable bytes escaped."""
    return name.encode("utf-8", "backslashreplace").decode()


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.walk's surrogate escapes of undecodable bytes
        return False
    return True


def sha256_of(directory: Path, relative: str) -> tuple[int, str] | None:
    """Size and sha256 of the regular file `relative` under `directory`, never through a link; else None."""
    f = open_beneath(directory, relative)
    if f is None:
        return None
    digest, size = hashlib.sha256(), 0
    with f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


class Guard(PeriodicCheck):
    """The check of a running job's outputs against its limits, at most every `every` seconds."""

    def __init__(
        self,
        directory: Path,
        limits: Limits,
        *,
        every: float = CHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory, self.limits = directory, limits
        super().__init__(self._over_limits, every=every, clock=clock)

    def _over_limits(self) -> JobError | None:
        why = measure(self.directory, self.limits).over
        return JobError(type=Failure.OUTPUT_TOO_LARGE, message=why) if why else None


def record(
    sessions: sessionmaker[Session], *, job_id: str, attempt: int, directory: Path, limits: Limits
) -> JobError | None:
    """Scan the outputs after an attempt's ranks are gone, record them as the job's artifacts.

    Returns OutputTooLarge's error when they are over a limit: then none are recorded (hashing ten
    times the limit is work nobody asked for), and the job fails.
    """
    found = measure(directory, limits) if directory.is_dir() else Found()
    rows: list[ArtifactRow] = []
    if found.over is None:
        for rel, _ in found.files:
            hashed = sha256_of(directory, rel)
            if hashed is None:
                found.skipped.append(f"{_shown(rel)} (unreadable, or no longer a regular file)")
                continue
            rows.append(ArtifactRow(path=rel, size_bytes=hashed[0], sha256=hashed[1]))
    try:
        with sessions.begin() as session:
            artifacts_repository.replace(session, job_id=job_id, attempt=attempt, rows=rows)
            if found.skipped:
                lifecycle.note_running(session, job_id=job_id, attempt=attempt, note=_skipped_note(found))
    except Exception:  # noqa: BLE001 - the attempt's end state matters more than its artifact list
        log.warning("job %s: recording its artifacts failed", job_id, exc_info=True)
    return JobError(type=Failure.OUTPUT_TOO_LARGE, message=found.over) if found.over else None


def _skipped_note(found: Found) -> str:
    named = "; ".join(found.skipped[:NAMED_SKIPS])
    more = f"; and {len(found.skipped) - NAMED_SKIPS} more" if len(found.skipped) > NAMED_SKIPS else ""
    return f"outputs: {len(found.skipped)} left out of the artifacts: {named}{more}"
