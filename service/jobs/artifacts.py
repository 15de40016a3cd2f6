"""A job's artifacts: what its DPTRAIN_OUTPUT_DIR held at its last attempt's end, listed and served."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from sqlalchemy.orm import Session

from api_schemas import ArtifactInfo, ArtifactList
from rank_contract.layout import JobFiles
from service.errors import NotFound
from service.files import open_beneath
from service.jobs import artifacts_repository, service
from service.models import JobArtifact, User


def list_artifacts(session: Session, *, user: User, job_id: str) -> ArtifactList:
    """The artifacts of a visible job, by path."""
    service.get_visible(session, user=user, job_id=job_id)
    rows = artifacts_repository.artifacts(session, job_id=job_id)
    return ArtifactList(
        items=[ArtifactInfo(path=r.path, size_bytes=r.size_bytes, sha256=r.sha256) for r in rows]
    )


def open_artifact(
    session: Session, *, user: User, job_id: str, path: str, artifact_root: Path
) -> tuple[JobArtifact, BinaryIO]:
    """A recorded artifact of a visible job and its file, opened beneath the job's outputs; else NotFound."""
    service.get_visible(session, user=user, job_id=job_id)
    row = artifacts_repository.artifact(session, job_id=job_id, path=path)
    if row is None:
        raise NotFound(f"job {job_id!r} has no artifact {path!r}")
    # Never through a link, whatever the row says: the ranks of a later attempt may plant one.
    f = open_beneath(JobFiles(artifact_root, job_id).outputs, path)
    if f is None:
        raise NotFound(f"artifact {path!r} of job {job_id!r} is no longer available")
    return row, f
