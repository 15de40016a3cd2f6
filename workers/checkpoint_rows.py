"""A job's checkpoint rows against its checkpoint files, checked and reconciled before an attempt starts."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service.jobs import repository as jobs_repository
from service.models.base import utcnow
from workers.attempts import Attempt


def missing_checkpoints(sessions: sessionmaker[Session], *, job_id: str, directory: Path) -> str | None:
    """Why this attempt must not start: the job recorded checkpoints but none of their files is left."""
    with sessions() as session:
        rows = jobs_repository.checkpoints(session, job_id=job_id)
    if not rows or any(directory.glob("ckpt-*.pt")):
        return None
    return (
        f"the job recorded {len(rows)} checkpoints (last at step {rows[-1].step}) but {directory} holds none"
    )


def sync_checkpoints(sessions: sessionmaker[Session], *, att: Attempt, directory: Path) -> None:
    """Make the job's checkpoint rows match its files before a restart.

    Ranks of a lost worker may have saved (and pruned, keep_last) checkpoints that nobody reported:
    list what is there, verified by its sidecar, and forget rows whose files are gone.
    """
    files: dict[int, Path] = {}
    for path in directory.glob("ckpt-*.pt"):
        if path.name[5:14].isdigit():
            files[int(path.name[5:14])] = path
    with sessions.begin() as session:
        rows = {c.step: c.path for c in jobs_repository.checkpoints(session, job_id=att.job_id)}
        gone = [path for step, path in rows.items() if step not in files]
        jobs_repository.delete_checkpoints(session, job_id=att.job_id, paths=gone)
        for step, path in sorted(files.items()):
            sidecar = path.with_name(path.name + ".sha256")
            if step in rows or not sidecar.exists():
                continue
            words = sidecar.read_text().split()
            row = {
                "job_id": att.job_id,
                "attempt": max(1, att.number - 1),
                "step": step,
                "path": str(path),
                "size_bytes": path.stat().st_size,
                "sha256": words[0] if words else "",
                "created_at": utcnow(),
            }
            jobs_repository.upsert_checkpoint(session, row=row)
        if not jobs_repository.fenced_update(session, job_id=att.job_id, claim_token=att.token, values={}):
            session.rollback()
