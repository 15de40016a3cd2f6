"""Training options of a job spec: the engine, checkpoints, evaluation."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, StringConstraints

from api_schemas.base import Strict

# What evaluation reports: `eval/loss` always, `eval/<name>` for each metric the plan computes. The
# engine checks the plan's metric names against the same pattern.
EVAL_METRIC_PATTERN = r"^eval/[A-Za-z][A-Za-z0-9_.\-]{0,63}$"
EvalMetricName = Annotated[str, StringConstraints(pattern=EVAL_METRIC_PATTERN)]


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
    compile: StrictBool = Field(
        False,
        description="Compile the model with torch.compile (after the DDP wrap, as torch documents for DDP).",
    )
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor",
        description="torch.compile backend; `inductor` needs a C++ compiler on CPU workers, Triton on GPUs.",
    )


class KeepBest(Strict):
    """Which evaluation figure makes a checkpoint the best one, and whether lower or higher is better."""

    metric: EvalMetricName = Field("eval/loss", description="An evaluation metric, e.g. `eval/loss`.")
    mode: Literal["min", "max"] = "min"


class CheckpointSpec(Strict):
    """When checkpoints are written and how many are kept; one is always written at the last step."""

    every_steps: int = Field(100, ge=1, le=100_000_000)
    keep_last: int = Field(3, ge=1, le=1000)
    keep_best: KeepBest | None = Field(
        None,
        description="Also keep the checkpoint with the best evaluation figure (needs `evaluation`); a new "
        "best is checkpointed at the evaluation that found it.",
    )


class EvaluationSpec(Strict):
    """Evaluation on the plan's eval dataset: every `every_steps` steps and at the end."""

    every_steps: int = Field(100, ge=1, le=100_000_000)
    max_batches: int | None = Field(
        None,
        ge=1,
        le=100_000_000,
        description="Evaluate on the first N eval batches only (of `batch_size`, or global batches); "
        "null: all.",
    )
    batch_size: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Samples per eval batch, each evaluated whole by one rank; null: global batches of "
        "the training's global_batch_size, each split over the ranks (a local batch per rank). Either "
        "way the samples evaluated do not depend on the world size.",
    )
