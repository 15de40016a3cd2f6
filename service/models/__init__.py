"""ORM models (SQLAlchemy 2, typed). Alembic migrations are the only source of the schema."""

from service.models.base import Base
from service.models.code import CodeArchive, CodeUpload
from service.models.jobs import (
    Checkpoint,
    Job,
    JobArtifact,
    JobTransition,
    LogLine,
    Metric,
    MetricRollup,
)
from service.models.stacks import RankStacks, StackRequest
from service.models.sweeps import Sweep, SweepTrial
from service.models.users import ApiToken, User
from service.models.webhooks import Webhook, WebhookDelivery
from service.models.workers import JobNode, Worker

__all__ = [
    "ApiToken",
    "Base",
    "Checkpoint",
    "CodeArchive",
    "CodeUpload",
    "Job",
    "JobArtifact",
    "JobNode",
    "JobTransition",
    "LogLine",
    "Metric",
    "MetricRollup",
    "RankStacks",
    "StackRequest",
    "Sweep",
    "SweepTrial",
    "User",
    "Webhook",
    "WebhookDelivery",
    "Worker",
]
