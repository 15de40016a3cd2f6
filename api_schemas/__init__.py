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
    Timeline,
    Transition,
    entrypoint_allowed,
)
from api_schemas.recipes import RECIPES
from api_schemas.users import IssuedToken, UserCreate, UserInfo
from api_schemas.workers import Worker, WorkerList

__all__ = [
    "RECIPES",
    "CheckpointInfo",
    "CheckpointList",
    "CheckpointSpec",
    "EngineOptions",
    "ErrorBody",
    "Hyperparameters",
    "IssuedToken",
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
    "Timeline",
    "Transition",
    "UserCreate",
    "UserInfo",
    "Worker",
    "WorkerList",
    "entrypoint_allowed",
]
