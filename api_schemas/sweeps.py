"""Hyperparameter sweeps: many trials (ordinary jobs) of one base spec, searched by a sampler."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

SPACE_KINDS = ("log_uniform", "uniform", "int", "choice")


class Objective(BaseModel):
    """The reported metric a sweep optimises."""

    model_config = ConfigDict(extra="forbid")
    metric: str = Field(min_length=1, max_length=128)
    direction: Literal["minimize", "maximize"] = "minimize"


class Pruner(BaseModel):
    """How running trials are stopped early: `median` (Optuna's MedianPruner) or `asha`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["none", "median", "asha"] = "none"
    # median: trials that must finish before any is pruned, and steps before a trial can be.
    n_startup_trials: int = Field(2, ge=0, le=1000)
    n_warmup_steps: int = Field(0, ge=0)
    # asha: the first rung's step and the reduction factor between rungs.
    min_resource: int = Field(1, ge=1)
    reduction_factor: int = Field(3, ge=2, le=100)


def _check_dimension(path: str, dim: dict[str, Any]) -> None:
    if len(dim) != 1 or next(iter(dim)) not in SPACE_KINDS:
        raise ValueError(f"space[{path!r}] must be exactly one of {', '.join(SPACE_KINDS)}")
    kind, value = next(iter(dim.items()))
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise ValueError(f"space[{path!r}].choice must be a non-empty list")
        return
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"space[{path!r}].{kind} must be [low, high]")
    lo, hi = value
    numbers = (int,) if kind == "int" else (int, float)
    if any(isinstance(v, bool) or not isinstance(v, numbers) for v in (lo, hi)):
        raise ValueError(
            f"space[{path!r}].{kind} bounds must be {'integers' if kind == 'int' else 'numbers'}"
        )
    if lo > hi:
        raise ValueError(f"space[{path!r}].{kind}: low {lo} is above high {hi}")
    if kind == "log_uniform" and lo <= 0:
        raise ValueError(f"space[{path!r}].log_uniform: low must be > 0")


class SweepCreate(BaseModel):
    """A sweep: a base job spec, a search space over dotted spec paths, an objective and limits."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    base: dict[str, JsonValue] = Field(description="A JobSpec (its name is replaced by `<name>-<number>`).")
    space: dict[str, dict[str, JsonValue]] = Field(
        min_length=1,
        max_length=32,
        description='"<dotted spec path>": {"log_uniform"|"uniform"|"int": [lo, hi]} or {"choice": [...]}',
    )
    objective: Objective
    sampler: Literal["random", "grid", "tpe"] = "random"
    pruner: Pruner = Field(default_factory=Pruner)
    max_trials: int = Field(ge=1, le=1000)
    max_concurrent_trials: int = Field(1, ge=1, le=100)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)

    @field_validator("space")
    @classmethod
    def _space(cls, space: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for path, dim in space.items():
            if not path or any(not part for part in path.split(".")):
                raise ValueError(f"space path {path!r} must be a dotted spec path such as hyperparameters.lr")
            _check_dimension(path, dim)
        return space

    @model_validator(mode="after")
    def _grid(self) -> SweepCreate:
        if self.sampler == "grid":
            for path, dim in self.space.items():
                if next(iter(dim)) in ("uniform", "log_uniform"):
                    raise ValueError(
                        f"space[{path!r}]: the grid sampler takes only choice and int dimensions"
                    )
        return self


class SweepState(str, enum.Enum):
    """Lifecycle of a sweep; `running -> succeeded|failed|cancelled`."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"
    FAILED = "failed"

    def is_terminal(self) -> bool:
        """True once the sweep can never change state again."""
        return self is not SweepState.RUNNING


class SweepTrial(BaseModel):
    """One trial: a job, its parameters, its status and its objective (its job succeeded)."""

    number: int
    job_id: str | None
    params: dict[str, JsonValue]
    # Its job's status (`pruned` when the pruner stopped it), `failed` if its job is gone: never
    # stored apart from the job, so the two cannot disagree.
    status: str
    objective: float | None = None
    steps: list[tuple[int, float]] | None = None


class SweepBest(BaseModel):
    """The best finished trial so far."""

    number: int
    job_id: str | None
    params: dict[str, JsonValue]
    objective: float


class Sweep(BaseModel):
    """A sweep as the API shows it."""

    id: str
    name: str
    owner: str
    state: SweepState
    spec: SweepCreate
    trials: list[SweepTrial]
    best: SweepBest | None
    created_at: datetime
    finished_at: datetime | None
    # Set when the sweep failed for a reason of its own (a later trial's submit refused).
    error: str | None = None


class SweepList(BaseModel):
    """A page of sweeps, newest first."""

    items: list[Sweep]
    next_cursor: str | None
