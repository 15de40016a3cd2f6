"""What the service answers about a job: its state, progress, error, metrics, logs, checkpoints, timeline."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from api_schemas.init_from import InitCheckpoint
from api_schemas.jobs import JobSpec, JobStatus


class Progress(BaseModel):
    """How far a job is: the last reported step, of `total_steps` when the job has a total."""

    step: int = 0
    total_steps: int | None = Field(
        description="The steps the job runs: `hyperparameters.steps`; null for a `command` that did not "
        "set it (its progress is the last step it reported, with no fraction)."
    )


class JobError(BaseModel):
    """Why a job failed: a type, a message, and where it came from."""

    type: str
    message: str
    rank: int | None = None
    traceback: str | None = Field(None, description="The tail of the failing rank's traceback.")


class EnvironmentBuild(BaseModel):
    """How the current attempt has its `environment`: being prepared, or ready (built or a cache hit)."""

    state: Literal["preparing", "ready"]
    started_at: datetime | None = Field(None, description="When this attempt started to prepare it.")
    key: str | None = Field(None, description="sha256 of the requirements and the worker's Python, torch.")
    cache_hit: bool | None = Field(None, description="True when the worker's cache already had it.")
    build_seconds: float | None = Field(None, description="How long having it took (a hit: the lookup).")


class Job(BaseModel):
    """A job as the service sees it."""

    id: str
    name: str
    status: JobStatus
    spec: JobSpec
    owner: str
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    progress: Progress
    attempt: int
    cancel_requested: bool = False
    error: JobError | None
    latest_metrics: dict[str, float] = Field(default_factory=dict)
    queued_reason: str | None = Field(
        None,
        description="Why a queued job has not started yet, e.g. `waiting for 2 nodes with 2 free cpu slots`.",
    )
    queue_position: int | None = Field(
        None,
        description="While queued: 1 for the job placement considers first among the queued jobs of its "
        "device kind, 2 for the next, and so on (higher `priority` first; within a priority each owner's "
        "first job, then each owner's second, ...; then oldest). Unplaceable jobs are not counted and have "
        "none; jobs held by their owner's running limit are. Computed when the job is read, at most "
        "`DPTRAIN_SCHEDULE_INTERVAL_SECONDS` old from an API process's poll cache; null once not queued.",
    )
    unplaceable: bool = Field(
        False,
        description="True while the job is queued and no set of live nodes of its device kind could ever "
        "hold it (fewer than `nodes` of them have `processes_per_node` slots): it waits until such nodes "
        "join. Judged at submit and again by every placement round; false once it is not queued.",
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="What the submitter should know now, in words. While `unplaceable`: one warning naming "
        "what the job needs and what the live nodes offer (the same text as `queued_reason`).",
    )
    init_checkpoint: InitCheckpoint | None = Field(
        None, description="The checkpoint its spec's `init_from` named, as resolved and pinned at submit."
    )
    environment_build: EnvironmentBuild | None = Field(
        None, description="How the current attempt has its spec's `environment` (null without one)."
    )


class JobList(BaseModel):
    items: list[Job]
    next_cursor: str | None


class MetricSeries(BaseModel):
    """Series per metric name, each a list of `[step, value]` in step order."""

    job_id: str
    series: dict[str, list[tuple[int, float]]]


class LogLine(BaseModel):
    id: int
    rank: int | None
    attempt: int
    line: str


class LogPage(BaseModel):
    items: list[LogLine]
    next_cursor: int | None = Field(None, description="Pass as `after` to read on from here.")


class CheckpointInfo(BaseModel):
    id: int
    step: int
    created_at: datetime
    size_bytes: int
    sha256: str
    best: bool = Field(
        False,
        description="The job's best checkpoint under `checkpoint.keep_best` (at most one of a job's is).",
    )


class CheckpointList(BaseModel):
    items: list[CheckpointInfo]


class Transition(BaseModel):
    """One status change of a job (`from_status` null: its submission)."""

    at: datetime
    from_status: JobStatus | None
    to_status: JobStatus
    attempt: int
    reason: str | None


class Timeline(BaseModel):
    """A job's status changes, oldest first."""

    items: list[Transition]


class ErrorBody(BaseModel):
    """Every non-validation error answers `{"error": <type>, "detail": <message>}`."""

    error: str
    detail: str | Any
