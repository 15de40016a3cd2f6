"""The wire contract of dptrain's REST API v1 (pydantic v2); imports nothing else of ours."""

from api_schemas.jobs import (
    CheckpointInfo,
    CheckpointList,
    CheckpointSpec,
    EngineOptions,
    ErrorBody,
    Hyperparameters,
    Job,
    JobError,
    JobList,
    JobSpec,
    JobStatus,
    LogLine,
    LogPage,
    MetricSeries,
    Progress,
    Resources,
)
from api_schemas.recipes import RECIPES, spec_errors

__all__ = [
    "RECIPES",
    "CheckpointInfo",
    "CheckpointList",
    "CheckpointSpec",
    "EngineOptions",
    "ErrorBody",
    "Hyperparameters",
    "Job",
    "JobError",
    "JobList",
    "JobSpec",
    "JobStatus",
    "LogLine",
    "LogPage",
    "MetricSeries",
    "Progress",
    "Resources",
    "spec_errors",
]
