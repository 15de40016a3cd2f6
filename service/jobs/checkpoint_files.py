"""A job's checkpoint files, found by job and step beneath the job's own folder: never by a stored path.

A checkpoint row's file is `<artifact root>/jobs/<job id>/checkpoints/<name of the step>`
(rank_contract.checkpoints names it), whatever the row's `path` says: rows were once written from
a path a rank reported, and a forged one named other jobs' files. Every reader opens it here,
with no link followed on the way (service.files.open_beneath), so a link a rank plants in its
folder leads nowhere either.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from rank_contract.checkpoints import CHECKPOINTS_FOLDER, checkpoint_name
from service.files import open_beneath


def checkpoint_dir(artifact_root: Path, job_id: str) -> Path:
    """The job's checkpoint folder on the artifact root (workers.attempt.node_run.RunPaths.checkpoint_dir)."""
    return artifact_root / "jobs" / job_id / CHECKPOINTS_FOLDER


def open_checkpoint(artifact_root: Path, *, job_id: str, step: int, suffix: str = "") -> BinaryIO | None:
    """Job `job_id`'s checkpoint file of `step` (or its sidecar `suffix`), opened; None if there is none."""
    try:
        name = checkpoint_name(step) + suffix
    except ValueError:  # a step no checkpoint file can have
        return None
    # The root resolved (an operator may point DPTRAIN_ARTIFACT_ROOT at a link); beneath it, no link.
    return open_beneath(artifact_root.resolve(), f"jobs/{job_id}/{CHECKPOINTS_FOLDER}/{name}")
