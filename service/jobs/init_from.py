"""`init_from` at submit: which checkpoint of the source job, and its file pinned for the new job.

Pinned by hard link: checkpoint files are never rewritten in place (a save writes aside and renames,
pruning unlinks), so a second name for the inode is an immutable copy that costs no bytes and no
time, and survives the source's keep_last pruning and the removal of its folder. The link lives in
the new job's own folder (`jobs/<id>/init/`, rank_contract.layout's `JobFiles.init`), with the
checkpoint's sidecars, and the sha256 the source recorded is kept on the new job: its attempts
verify the file against it before the first step (workers/attempt/init_checkpoint.py). A copy is
made only where a link cannot be (another file system).

The source file is the source job's checkpoint of that step in its own folder, opened there with
no link followed (service.jobs.checkpoint_files), never the path its row holds; the link is made
to that open file, so nothing swapped in after the open is pinned instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy.orm import Session

from api_schemas import InitFrom
from rank_contract.layout import JobFiles
from service.errors import NotFound, invalid_field
from service.jobs import repository
from service.jobs.checkpoint_files import open_checkpoint
from service.models import Checkpoint, Job

# The checkpoint's sidecars (workers/engine/checkpoint.py names them; the service never imports it).
SIDECARS = (".sha256", ".xxh128")
_LOC = ("body", "init_from")


def row_values(
    session: Session, *, owner_id: int | None, init: InitFrom, job_id: str, artifacts: Path
) -> dict[str, Any]:
    """The new job's init_* columns: the source's checkpoint that `init` names, checked.

    `owner_id`: the submitter's, None for an admin (who may read every job). 404 when the source is
    not theirs (the answer GET of it gives), 422 naming the field when it has no such checkpoint.
    The file is pinned only once the job row exists (`pin_for`).
    """
    source = repository.get(session, job_id=init.job, owner_id=owner_id)
    if source is None:
        raise NotFound(f"init_from.job: job {init.job!r} not found")
    ckpt = choose(repository.checkpoints(session, job_id=source.id), init=init)
    return {
        "init_job": source.id,
        "init_step": ckpt.step,
        "init_sha256": ckpt.sha256,
        "init_path": str(JobFiles(artifacts.resolve(), job_id).init_checkpoint(ckpt.step)),
    }


def pin_for(session: Session, *, job: Job, artifacts: Path) -> None:
    """Pin the source checkpoint of `job`, created now with `init_from` (nothing for a job without)."""
    if job.init_job is None or job.init_step is None:
        return
    source = repository.checkpoint_of_step(session, job_id=job.init_job, step=job.init_step)
    if source is None:  # pruned between the check and now
        message = f"the checkpoint of step {job.init_step} is no longer available (pruned meanwhile?)"
        raise invalid_field(_LOC, message, job.init_job)
    # The file, not the row, decides: pin() answers the same 422 if the pruning got there first.
    pin(artifacts=artifacts, job_id=job.id, source=source)


def choose(rows: Sequence[Checkpoint], *, init: InitFrom) -> Checkpoint:
    """The source's checkpoint that `init` names; a 422 naming the field when it has none such."""
    if init.step is not None:
        found = [c for c in rows if c.step == init.step]
        if not found:
            steps = ", ".join(str(c.step) for c in rows) or "none"
            msg = f"job {init.job} has no checkpoint of step {init.step} (its checkpoints: {steps})"
            raise invalid_field((*_LOC, "step"), msg, init.step)
        return found[0]
    if init.best:
        found = [c for c in rows if c.best]
        if not found:
            msg = f"job {init.job} has no best checkpoint (it needs checkpoint.keep_best)"
            raise invalid_field((*_LOC, "best"), msg, init.best)
        return found[0]
    if not rows:
        raise invalid_field((*_LOC, "job"), f"job {init.job} has no checkpoint", init.job)
    return max(rows, key=lambda c: c.step)


def pin(*, artifacts: Path, job_id: str, source: Checkpoint) -> Path:
    """Link (or copy) the source checkpoint and its sidecars into the new job's folder; the file's path.

    A 422 when the source job's folder has no such file (pruned between the listing and now, or
    never there: a row's stored path is not looked at).
    """
    root = artifacts.resolve()
    files = JobFiles(root, job_id)
    dest = files.init_checkpoint(source.step)
    src = open_checkpoint(root, job_id=source.job_id, step=source.step)
    if src is None:
        msg = f"the checkpoint of step {source.step} is no longer available (pruned meanwhile?)"
        raise invalid_field(_LOC, msg, source.job_id)
    files.init.mkdir(parents=True, exist_ok=True)
    with src:
        _link_or_copy(src, dest)
    for suffix in SIDECARS:
        sidecar = open_checkpoint(root, job_id=source.job_id, step=source.step, suffix=suffix)
        if sidecar is not None:
            with sidecar:
                _link_or_copy(sidecar, dest.with_name(dest.name + suffix))
    return dest


def _link_or_copy(src: BinaryIO, dest: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        dest.unlink()
    folder = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # linkat(2)'s way to link an open file (AT_SYMLINK_FOLLOW on its /proc/self/fd entry): the
        # very file opened beneath the source's folder, whatever was renamed in there since. The
        # folder's fd makes os.link call linkat (without one it calls link(2), which follows nothing).
        os.link(
            f"/proc/self/fd/{src.fileno()}",
            dest.name,
            src_dir_fd=folder,
            dst_dir_fd=folder,
            follow_symlinks=True,
        )
    except OSError:
        # Another file system, no hard links, no /proc, or the file unlinked since the open (pruned):
        # a private copy of the open file's bytes does the same job.
        with os.fdopen(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            shutil.copyfileobj(src, out)
    finally:
        os.close(folder)
