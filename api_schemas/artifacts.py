"""A job's artifacts: the regular files its DPTRAIN_OUTPUT_DIR held at the end of its last attempt."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ArtifactInfo(BaseModel):
    path: str = Field(description="Relative to the job's DPTRAIN_OUTPUT_DIR, '/'-separated.")
    size_bytes: int
    sha256: str


class ArtifactList(BaseModel):
    items: list[ArtifactInfo]
