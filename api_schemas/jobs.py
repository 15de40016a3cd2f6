"""Job spec (what a user submits) and job (what the service answers)."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints

Name = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
]
LabelKey = Annotated[
    str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-/]*$")
]
LabelValue = Annotated[str, StringConstraints(max_length=256)]


class Strict(BaseModel):
    """Base for request models: unknown fields are refused, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid")


class JobStatus(str, enum.Enum):
    """Lifecycle of a job; `queued -> running -> succeeded|failed|cancelled`."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def is_terminal(self) -> bool:
        """True once the job can never change state again."""
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class Hyperparameters(BaseModel):
    """Optimisation settings; recipe-specific extras are allowed and checked against the recipe."""

    model_config = ConfigDict(extra="allow")

    global_batch_size: int = Field(
        64, ge=1, le=1_000_000, description="Samples per optimizer step, all ranks together."
    )
    lr: float = Field(0.05, gt=0, le=100)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    steps: int = Field(100, ge=1, le=100_000_000, description="Optimizer steps to run (ITER at the end).")
    seed: int = Field(0, ge=0, le=2**31 - 1)


class Resources(Strict):
    """Where the job's ranks run."""

    nodes: int = Field(
        1,
        ge=1,
        le=256,
        description="Worker nodes the job runs on, all at once (gang-scheduled) or not at all.",
    )
    processes_per_node: int = Field(
        1, ge=1, le=64, description="Ranks per node; each takes a slot of its node."
    )
    device: Literal["cpu", "cuda"] = "cpu"


class EngineOptions(Strict):
    """Data-parallel engine options."""

    bucket_cap_mb: float = Field(25.0, gt=0, le=1024, description="Gradient allreduce bucket size.")
    log_every_steps: int = Field(1, ge=1, le=1_000_000, description="Report metrics every N steps.")
    collective_timeout_seconds: int = Field(300, ge=5, le=86_400)
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="Autocast dtype for forward and loss; parameters and optimizer stay fp32."
    )
    grad_accumulation_steps: int = Field(
        1,
        ge=1,
        le=1024,
        description="Micro-batches per optimizer step; must divide global_batch_size / world size.",
    )
    grad_clip_norm: float | None = Field(
        None, gt=0, description="Clip the averaged gradient's total L2 norm to this; null for no clipping."
    )
    buffers: Literal["broadcast", "average"] = Field(
        "average",
        description="Keep buffers (BatchNorm running stats) in step across ranks: `average` them after every "
        "step (uses every rank's data) or `broadcast` rank 0's at every forward.",
    )
    sync_batchnorm: StrictBool = Field(
        False,
        description="BatchNorm over the whole global batch (SyncBatchNorm) instead of each rank's shard.",
    )
    mode: Literal["allreduce", "local_sgd"] = Field(
        "allreduce",
        description="`allreduce` averages gradients every step; `local_sgd` lets each rank step on its own "
        "gradient and averages parameters every `local_sgd_period` steps (after the warm-up).",
    )
    local_sgd_period: int = Field(4, ge=1, le=1_000_000, description="LocalSGD: steps between averagings.")
    local_sgd_warmup_steps: int = Field(
        0, ge=0, le=100_000_000, description="LocalSGD: ordinary allreduce steps before local steps begin."
    )
    sparse: Literal["allgather", "dense"] = Field(
        "allgather",
        description="Sparse gradients (embeddings): all-gather each rank's touched rows, or densify and "
        "allreduce.",
    )
    activation_checkpointing: StrictBool = Field(
        False, description="Recompute activations in backward instead of storing them: less memory."
    )


class CheckpointSpec(Strict):
    """When checkpoints are written and how many are kept; one is always written at the last step."""

    every_steps: int = Field(100, ge=1, le=100_000_000)
    keep_last: int = Field(3, ge=1, le=1000)


class JobSpec(Strict):
    """What a user submits to `POST /v1/jobs`."""

    name: Name
    recipe: str | None = Field(None, description="A built-in recipe, e.g. `mlp`.")
    entrypoint: str | None = Field(
        None,
        max_length=256,
        description="User code: `package.module:function` returning the engine's plan; only modules under "
        "the server's DPTRAIN_ALLOWED_ENTRYPOINTS prefixes run.",
    )
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    resources: Resources = Field(default_factory=Resources)
    engine: EngineOptions = Field(default_factory=EngineOptions)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    max_restarts: int = Field(0, ge=0, le=100)
    max_runtime_seconds: int | None = Field(None, ge=1, le=30 * 86_400)
    priority: int = Field(0, ge=-1000, le=1000)
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64)

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.resources.nodes * self.resources.processes_per_node


class Progress(BaseModel):
    step: int = 0
    total_steps: int


class JobError(BaseModel):
    """Why a job failed: a type, a message, and where it came from."""

    type: str
    message: str
    rank: int | None = None
    traceback: str | None = Field(None, description="The tail of the failing rank's traceback.")


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
