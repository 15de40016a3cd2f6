"""A job's checkpoint files, found by job and step beneath the job's own folder: never by a stored path.

A checkpoint row's file is `<artifact root>/jobs/<job id>/checkpoints/<name of the step>`
(rank_contract.layout's `JobFiles.checkpoint`), whatever the row's `path` says: rows were once written from
a path a rank reported, and a forged one named other jobs' files. Every reader opens it here,
with no link followed on the way (service.files.open_beneath), so a link a rank plants in its
folder leads nowhere either.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from rank_contract.layout import JobFiles
from service.files import open_beneath


def open_checkpoint(artifact_root: Path, *, job_id: str, step: int, suffix: str = "") -> BinaryIO | None:
    """Job `job_id`'s checkpoint file of `step` (or its sidecar `suffix`), opened; None if there is none."""
    # The root resolved (an operator may point DPTRAIN_ARTIFACT_ROOT at a link); beneath it, no link.
    files = JobFiles(artifact_root.resolve(), job_id)
    try:
        path = files.checkpoint(step)
    except ValueError:  # a step no checkpoint file can have
        return None
    return open_beneath(files.root, files.relative(path) + suffix)
