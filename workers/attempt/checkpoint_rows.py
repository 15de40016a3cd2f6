"""A job's checkpoint rows against its files: checked before an attempt, reconciled before and after one.

The folder is written by the job's ranks, so nothing in it is trusted: only regular files with a
checkpoint's name count (lstat, no link followed), and sidecars and the best marker are read
beneath the folder without following a link, within a few bytes.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from rank_contract.checkpoints import MAX_STEP, checkpoint_name, step_of
from service.files import open_beneath
from service.jobs import repository as jobs_repository
from service.models.base import utcnow
from workers.attempt.node_run import Attempt
from workers.engine.checkpoint import CheckpointManager, best_marker

# A sidecar holds one digest and a name; the best marker one step: more is not theirs.
_SMALL_FILE_BYTES = 4096
_SHA256 = re.compile(r"[0-9a-f]{64}")


def checkpoint_sizes(directory: Path) -> dict[int, int]:
    """The size of each regular checkpoint file in `directory` by step, oldest first (links left out)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    found: dict[int, int] = {}
    for name in names:
        if (step := step_of(name)) is None:
            continue
        try:
            info = os.lstat(directory / name)
        except OSError:
            continue  # pruned since the listing
        if stat.S_ISREG(info.st_mode):
            found[step] = info.st_size
    return dict(sorted(found.items()))


def _small_file(directory: Path, name: str) -> str | None:
    f = open_beneath(directory, name)
    if f is None:
        return None
    with f:
        return f.read(_SMALL_FILE_BYTES).decode("ascii", errors="replace")


def _sha256_of_sidecar(directory: Path, step: int) -> str | None:
    sidecar = CheckpointManager.sidecar_for(Path(checkpoint_name(step))).name
    words = (_small_file(directory, sidecar) or "").split()
    return words[0] if words and _SHA256.fullmatch(words[0]) else None


def _best_step(directory: Path, steps: dict[int, int]) -> int | None:
    text = (_small_file(directory, best_marker(directory).name) or "").strip()
    if not text.isascii() or not text.isdigit() or int(text) > MAX_STEP:
        return None
    return int(text) if int(text) in steps else None


def missing_checkpoints(sessions: sessionmaker[Session], *, job_id: str, directory: Path) -> str | None:
    """Why this attempt must not start: the job recorded checkpoints but none of their files is left."""
    with sessions() as session:
        rows = jobs_repository.checkpoints(session, job_id=job_id)
    if not rows or checkpoint_sizes(directory):
        return None
    return (
        f"the job recorded {len(rows)} checkpoints (last at step {rows[-1].step}) but {directory} holds none"
    )


def sync_checkpoints(sessions: sessionmaker[Session], *, att: Attempt, directory: Path, attempt: int) -> None:
    """Make the job's checkpoint rows match its files: before a restart and at every attempt's end.

    Ranks may have saved (and pruned, keep_last) checkpoints whose events were never read: a lost
    worker's, or a save cut by a cancel or a kill. List what is there, verified by its sidecar
    (rows found are `attempt`'s), and forget rows whose files are gone. The best mark follows the
    engine's marker file (checkpoint.keep_best), which a killed attempt may have moved without its
    event ever being read.
    """
    files = checkpoint_sizes(directory)
    best = _best_step(directory, files)
    with sessions.begin() as session:
        rows = {c.step for c in jobs_repository.checkpoints(session, job_id=att.job_id)}
        gone = [step for step in rows if step not in files]
        jobs_repository.delete_checkpoints(session, job_id=att.job_id, steps=gone)
        for step, size in files.items():
            if step in rows or (sha256 := _sha256_of_sidecar(directory, step)) is None:
                continue
            row = {
                "job_id": att.job_id,
                "attempt": attempt,
                "step": step,
                "path": str(directory / checkpoint_name(step)),
                "size_bytes": size,
                "sha256": sha256,
                "created_at": utcnow(),
                "best": step == best,
            }
            jobs_repository.upsert_checkpoint(session, row=row)
        # Kept rows too: a best reported before the kill may since have been superseded on disk.
        jobs_repository.mark_best_checkpoint(session, job_id=att.job_id, step=best)
        if not jobs_repository.fenced_update(session, job_id=att.job_id, claim_token=att.token, values={}):
            session.rollback()
