"""A job's `init_from` checkpoint on the worker: verified against the sha256 recorded at submit.

The service pinned the file under the job's folder (service/jobs/init_from.py). Before the ranks
start, while the job has no checkpoint of its own (its own always win), every node hashes the file
and refuses to start on a mismatch: a damaged or replaced source would otherwise train on silently.
A mismatch is not retried (rank_contract/failures.py): the same file fails the same way.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from api_schemas import JobError
from rank_contract.failures import Failure
from rank_contract.files import open_beneath
from workers.engine.checkpoint import checkpoint_files

_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class InitCheckpoint:
    """The pinned file a job starts from and the sha256 its source recorded for it."""

    path: Path
    sha256: str
    source_job: str
    step: int

    @property
    def folder(self) -> Path:
        """The folder the sandbox shows read-only (the file and its sidecars)."""
        return self.path.parent


def of_row(
    *, job_id: str | None, step: int | None, path: str | None, sha256: str | None
) -> InitCheckpoint | None:
    """The job row's init_* columns as an InitCheckpoint (None for a job without `init_from`)."""
    if job_id is None or step is None or path is None or sha256 is None:
        return None
    return InitCheckpoint(path=Path(path), sha256=sha256, source_job=job_id, step=step)


def needed(init: InitCheckpoint | None, *, checkpoint_dir: Path) -> InitCheckpoint | None:
    """The init checkpoint if the ranks will start from it: the job has none of its own yet."""
    return init if init is not None and not checkpoint_files(checkpoint_dir) else None


def verify(init: InitCheckpoint) -> JobError | None:
    """Why the ranks must not start from `init` (missing, or not the bytes recorded), None if they may."""
    what = f"the init_from checkpoint (job {init.source_job}, step {init.step})"
    # The folder was handed to the ranks' user by an earlier attempt: the file is opened without
    # following a link, and must be a regular file (rank_contract.files).
    f = open_beneath(init.path.parent, init.path.name)
    if f is None:
        return JobError(
            type=Failure.INIT_CHECKPOINT_MISSING,
            message=f"{what} is gone: {init.path} is missing or not a regular file",
        )
    digest = hashlib.sha256()
    with f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    actual = digest.hexdigest()
    if actual != init.sha256:
        message = f"{what} does not verify: sha256 {actual} != {init.sha256} recorded at submit"
        return JobError(type=Failure.INIT_CHECKPOINT_MISMATCH, message=message)
    return None


def unshare(folder: Path) -> None:
    """Make each hard-linked file in `folder` a copy of its own, before it is given to the ranks' user.

    The pinned files share their inode with the source's checkpoint: handing them over (chown) would
    hand over the source's file too, and taking them back after the attempt would take it from the
    source's ranks. Once per job: a copy has one link.
    """
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.is_symlink() and path.stat().st_nlink > 1:
            copy = path.with_name(f".{path.name}.unshared")
            shutil.copyfile(path, copy)
            os.chmod(copy, 0o600)
            os.replace(copy, path)
