"""A job's checkpoint rows against its checkpoint files, checked and reconciled before an attempt starts."""

from __future__ import annotations

import stat
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service.jobs import repository as jobs_repository
from service.models.base import utcnow
from workers.engine.checkpoint import CheckpointManager, checkpoint_files, read_best_step, sidecar_digest
from workers.node_run import Attempt


def missing_checkpoints(sessions: sessionmaker[Session], *, job_id: str, directory: Path) -> str | None:
    """Why this attempt must not start: the job recorded checkpoints but none of their files is left."""
    with sessions() as session:
        rows = jobs_repository.checkpoints(session, job_id=job_id)
    if not rows or checkpoint_files(directory):
        return None
    return (
        f"the job recorded {len(rows)} checkpoints (last at step {rows[-1].step}) but {directory} holds none"
    )


def sync_checkpoints(sessions: sessionmaker[Session], *, att: Attempt, directory: Path) -> None:
    """Make the job's checkpoint rows match its files before a restart.

    Ranks of a lost worker may have saved (and pruned, keep_last) checkpoints that nobody reported:
    list what is there, verified by its sidecar, and forget rows whose files are gone. The best
    mark follows the engine's marker file (checkpoint.keep_best), which a killed attempt may have
    moved without its event ever being read.
    """
    files = checkpoint_files(directory)
    best = read_best_step(directory)
    with sessions.begin() as session:
        rows = {c.step: c.path for c in jobs_repository.checkpoints(session, job_id=att.job_id)}
        gone = [path for step, path in rows.items() if step not in files]
        jobs_repository.delete_checkpoints(session, job_id=att.job_id, paths=gone)
        for step, path in files.items():
            sidecar = CheckpointManager.sidecar_for(path)
            if step in rows or not sidecar.exists():
                continue
            # The ranks write the folder: a link or anything but a regular file is no checkpoint.
            try:
                st = path.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            row = {
                "job_id": att.job_id,
                "attempt": max(1, att.number - 1),
                "step": step,
                "path": str(path),
                "size_bytes": st.st_size,
                "sha256": sidecar_digest(sidecar),
                "created_at": utcnow(),
                "best": step == best,
            }
            jobs_repository.upsert_checkpoint(session, row=row)
        # Kept rows too: a best reported before the kill may since have been superseded on disk.
        jobs_repository.mark_best_checkpoint(session, job_id=att.job_id, step=best)
        if not jobs_repository.fenced_update(session, job_id=att.job_id, claim_token=att.token, values={}):
            session.rollback()
