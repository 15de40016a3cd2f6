"""The wire contract of dptrain's REST API v1 (pydantic v2); imports nothing else of ours."""

from api_schemas.artifacts import ArtifactInfo, ArtifactList
from api_schemas.base import MAX_PRIORITY
from api_schemas.init_from import InitCheckpoint, InitFrom
from api_schemas.job_views import (
    CheckpointInfo,
    CheckpointList,
    EnvironmentBuild,
    ErrorBody,
    Job,
    JobError,
    JobList,
    LogLine,
    LogPage,
    MetricSeries,
    Progress,
    Timeline,
    Transition,
)
from api_schemas.jobs import (
    CheckpointSpec,
    CodeRef,
    EngineOptions,
    Hyperparameters,
    JobSpec,
    JobStatus,
    Resources,
    entrypoint_allowed,
)
from api_schemas.recipes import EVAL_METRICS, RECIPES
from api_schemas.stacks import JobStacks, ProcessStack, StackDump, StackFrame, StackReason, ThreadStack
from api_schemas.sweeps import Objective, Pruner, Sweep, SweepBest, SweepCreate, SweepList, SweepTrial
from api_schemas.training import EVAL_METRIC_PATTERN, EvaluationSpec, KeepBest
from api_schemas.users import IssuedToken, UserCreate, UserInfo
from api_schemas.webhooks import (
    WebhookCreate,
    WebhookCreated,
    WebhookDelivery,
    WebhookDeliveryList,
    WebhookInfo,
    WebhookList,
)
from api_schemas.workers import Worker, WorkerList

__all__ = [
    "ArtifactInfo",
    "ArtifactList",
    "EnvironmentBuild",
    "EVAL_METRICS",
    "MAX_PRIORITY",
    "EVAL_METRIC_PATTERN",
    "RECIPES",
    "CheckpointInfo",
    "CheckpointList",
    "CheckpointSpec",
    "CodeRef",
    "EngineOptions",
    "ErrorBody",
    "EvaluationSpec",
    "Hyperparameters",
    "IssuedToken",
    "Job",
    "JobError",
    "JobList",
    "InitCheckpoint",
    "InitFrom",
    "JobSpec",
    "JobStacks",
    "JobStatus",
    "KeepBest",
    "LogLine",
    "LogPage",
    "MetricSeries",
    "ProcessStack",
    "Progress",
    "Resources",
    "StackDump",
    "StackFrame",
    "StackReason",
    "ThreadStack",
    "Timeline",
    "Transition",
    "UserCreate",
    "UserInfo",
    "Objective",
    "Pruner",
    "Sweep",
    "SweepBest",
    "SweepCreate",
    "SweepList",
    "SweepTrial",
    "WebhookCreate",
    "WebhookCreated",
    "WebhookDelivery",
    "WebhookDeliveryList",
    "WebhookInfo",
    "WebhookList",
    "Worker",
    "WorkerList",
    "entrypoint_allowed",
]
