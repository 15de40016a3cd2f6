"""SQL of a job's artifacts: the regular files its DPTRAIN_OUTPUT_DIR held at its last attempt's end."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from service.models import JobArtifact


@dataclass(frozen=True)
class ArtifactRow:
    """One scanned file: its path relative to the outputs directory, size and sha256."""

    path: str
    size_bytes: int
    sha256: str


def replace(session: Session, *, job_id: str, attempt: int, rows: Iterable[ArtifactRow]) -> None:
    """Make `rows` the job's artifacts: each scan sees the whole directory, so it replaces the last one."""
    session.execute(delete(JobArtifact).where(JobArtifact.job_id == job_id))
    values = [
        {"job_id": job_id, "attempt": attempt, "path": r.path, "size_bytes": r.size_bytes, "sha256": r.sha256}
        for r in rows
    ]
    if values:
        session.execute(insert(JobArtifact), values)


def artifacts(session: Session, *, job_id: str) -> Sequence[JobArtifact]:
    """The job's artifacts, by path."""
    query = select(JobArtifact).where(JobArtifact.job_id == job_id).order_by(JobArtifact.path)
    return session.scalars(query).all()


def artifact(session: Session, *, job_id: str, path: str) -> JobArtifact | None:
    """The job's artifact at `path`, if the last scan recorded one."""
    query = select(JobArtifact).where(JobArtifact.job_id == job_id, JobArtifact.path == path)
    return session.scalars(query).first()
