"""Routes of a job's artifacts: `/v1/jobs/{id}/artifacts`, listed and streamed."""

from __future__ import annotations

from pathlib import PurePosixPath

from fastapi.responses import StreamingResponse

from api_schemas import ArtifactList
from service.deps import CurrentUser, SessionDep, SettingsDep
from service.downloads import attachment
from service.errors import NotFound, error_responses
from service.jobs import artifacts
from service.params import ArtifactPath, JobId
from service.routing import v1_router

router = v1_router("jobs")

_ARTIFACT_FILE: dict[int | str, dict[str, object]] = {
    200: {
        "description": "The artifact's bytes",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        "headers": {
            "X-Artifact-SHA256": {
                "description": "sha256 of the file when its attempt ended, hex",
                "schema": {"type": "string"},
            }
        },
    }
}


@router.get("/{job_id}/artifacts", response_model=ArtifactList, responses=error_responses(NotFound))
def list_artifacts(job_id: JobId, session: SessionDep, user: CurrentUser) -> ArtifactList:
    """The job's artifacts: the regular files its DPTRAIN_OUTPUT_DIR held when its last attempt ended."""
    return artifacts.list_artifacts(session, user=user, job_id=job_id)


@router.get(
    "/{job_id}/artifacts/{path:path}",
    response_class=StreamingResponse,
    responses=_ARTIFACT_FILE | error_responses(NotFound),
)
def download_artifact(
    job_id: JobId, path: ArtifactPath, session: SessionDep, user: CurrentUser, settings: SettingsDep
) -> StreamingResponse:
    """One artifact's bytes, streamed; X-Artifact-SHA256 is what its attempt's end recorded."""
    row, f = artifacts.open_artifact(
        session, user=user, job_id=job_id, path=path, artifact_root=settings.artifacts
    )
    headers = {"X-Artifact-SHA256": row.sha256}
    return attachment(f, name=PurePosixPath(path).name, headers=headers)
