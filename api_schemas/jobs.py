"""The job spec: what a user submits (the answers about a job are in api_schemas.job_views)."""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationError,
    WithJsonSchema,
    field_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from api_schemas.base import MAX_PRIORITY, JsonValue, Strict
from api_schemas.code import CodeRef, CommandArg, EnvName, EnvValue
from api_schemas.data import DataSpec, data_rules
from api_schemas.environment import EnvironmentSpec
from api_schemas.init_from import InitFrom
from api_schemas.recipes import EVAL_METRICS, RECIPES
from api_schemas.training import CheckpointSpec, EngineOptions, EvaluationSpec

Name = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
]
LabelKey = Annotated[
    str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-/]*$")
]
# No NUL: PostgreSQL stores none in text or JSONB (the engine reads the same rule from here).
LabelValue = Annotated[str, StringConstraints(max_length=256, pattern=r"^[^\x00]*$")]
# `package.module:function`, matched whole; the function must be public (no leading underscore).
ENTRYPOINT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z][A-Za-z0-9_]*$"


def _entrypoint_form(value: str) -> str:
    # fullmatch, not `$`: Python's `$` also matches before a trailing newline.
    if re.fullmatch(ENTRYPOINT_PATTERN[1:-1], value) is None:
        raise ValueError("expected 'package.module:function' naming a public function (no leading '_')")
    return value


# Checked with the other cross-field rules (for a message that lists the known ones), and named in
# the OpenAPI schema so clients see the choices.
RecipeName = Annotated[str, WithJsonSchema({"type": "string", "enum": sorted(RECIPES)})]
Entrypoint = Annotated[
    str,
    StringConstraints(max_length=256),
    AfterValidator(_entrypoint_form),
    # The same rule in the OpenAPI schema, so generated clients and fuzzers know it.
    WithJsonSchema({"type": "string", "maxLength": 256, "pattern": ENTRYPOINT_PATTERN}),
]


class JobStatus(str, enum.Enum):
    """Lifecycle of a job; `queued -> running -> succeeded|failed|cancelled|pruned`."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # A sweep's trial its pruner stopped (through the cancel path): cancelled for a reason of its own.
    PRUNED = "pruned"

    def is_terminal(self) -> bool:
        """True once the job can never change state again."""
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.PRUNED)


class Hyperparameters(Strict):
    """Optimisation settings; extras belong to the recipe (checked against its model) or the entrypoint."""

    model_config = ConfigDict(extra="allow")
    # An entrypoint's extras are its own business, but still plain, finite, bounded JSON.
    __pydantic_extra__: dict[str, JsonValue] = Field(init=False)

    global_batch_size: int = Field(
        64, ge=1, le=1_000_000, description="Samples per optimizer step, all ranks together."
    )
    lr: float = Field(0.05, gt=0, le=100)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    steps: int = Field(
        100,
        ge=1,
        le=100_000_000,
        description="Optimizer steps to run (ITER at the end). For a `command`: optional, the total that "
        "the steps of `dptrain.report` count against in the job's progress; without it the progress is "
        "the last reported step, with no total.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds model init, data and sampling.")


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


class JobSpec(Strict):
    """What a user submits to `POST /v1/jobs`."""

    # The hyperparameters' serializer below hands its dict back through pydantic's any-serializer,
    # which in JSON mode turns a NaN into null without a word; "constants" keeps it a float, so a
    # writer with allow_nan=False (the ranks' spec.json) still refuses one that got past validation.
    model_config = ConfigDict(**Strict.model_config, ser_json_inf_nan="constants")

    name: Name
    recipe: RecipeName | None = Field(None, description="A built-in recipe, e.g. `mlp`.")
    entrypoint: Entrypoint | None = Field(
        None,
        description="User code: `package.module:function` returning the engine's plan, from the uploaded "
        "`code` tree or, without one, a module under the server's DPTRAIN_ALLOWED_ENTRYPOINTS prefixes.",
    )
    command: list[CommandArg] | None = Field(
        None,
        min_length=1,
        max_length=256,
        description='A program started on every rank under torchrun, e.g. `["python", "train.py"]`; '
        "a leading `python` is the worker's interpreter. Its exit codes decide the job's result. No shell "
        "runs it: `$VAR` stays as written, but `$(NAME)` in an argument is the rank's variable NAME "
        "(`--data=$(DPTRAIN_DATA_ROOT)/x`; as in Kubernetes, `$$` is one `$` and an unset NAME stays "
        "as written).",
    )
    code: CodeRef | None = Field(
        None, description="The uploaded working directory: the ranks' working directory and PYTHONPATH."
    )
    env: dict[EnvName, EnvValue] = Field(
        default_factory=dict, max_length=128, description="Variables added to the ranks' environment."
    )
    environment: EnvironmentSpec | None = Field(
        None,
        description="Python packages the ranks need beyond the worker's, built once per worker into a "
        "cached environment (docs/code.md#python-packages).",
    )
    stall_timeout_seconds: int = Field(
        1800,
        ge=10,
        le=7 * 86_400,
        description="End the attempt (restart or fail) when no rank reports a step or writes a log line "
        "for this long.",
    )
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    resources: Resources = Field(default_factory=Resources)
    engine: EngineOptions = Field(default_factory=EngineOptions)
    data: DataSpec = Field(
        default_factory=DataSpec,
        description="How the ranks load batches (DataLoader options) and which data files they read.",
    )
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    init_from: InitFrom | None = Field(
        None,
        description="Start from a checkpoint of a job you may read (docs/api.md); the job's own "
        "checkpoints, once it has any, win over it.",
    )
    evaluation: EvaluationSpec | None = Field(
        None,
        description="Evaluate on the plan's eval dataset (a recipe's eval split); reports `eval/loss` and "
        "`eval/<name>` metrics.",
    )
    max_restarts: int = Field(0, ge=0, le=100)
    max_runtime_seconds: int | None = Field(None, ge=1, le=30 * 86_400)
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64)

    @field_serializer("hyperparameters", mode="wrap")
    def _sent_hyperparameters(self, value: Hyperparameters, handler: SerializerFunctionWrapHandler):
        # A command uses none of the defaults (lr, global_batch_size...): its spec stores and shows
        # only what was sent. No return annotation: pydantic would make it the field's OpenAPI schema.
        dumped = handler(value)
        if self.command is None or not isinstance(dumped, dict):
            return dumped
        sent = value.model_fields_set | set(value.model_extra or {})
        return {k: v for k, v in dumped.items() if k in sent}

    @property
    def progress_total(self) -> int | None:
        """The steps a job's progress counts against: a command's only when it sent `steps`."""
        hp = self.hyperparameters
        return hp.steps if self.command is None or "steps" in hp.model_fields_set else None

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.resources.nodes * self.resources.processes_per_node

    def local_batch_size(self, world_size: int | None = None) -> int:
        """Samples per rank and step at `world_size` ranks (default: the spec's); ValueError if uneven."""
        world = world_size or self.world_size
        if (reason := self._uneven_batch(world)) is not None:
            raise ValueError(reason)
        return self.hyperparameters.global_batch_size // world

    def recipe_params(self) -> BaseModel | None:
        """A built-in recipe's extras as its model, defaults filled in; None for an entrypoint."""
        model = RECIPES.get(self.recipe or "")
        return model.model_validate(self.hyperparameters.model_extra or {}) if model else None

    def _uneven_batch(self, world: int) -> str | None:
        b, accum = self.hyperparameters.global_batch_size, self.engine.grad_accumulation_steps
        if b % (world * accum) == 0:
            return None
        # Unequal shards or micro-batches would weight samples unequally in the averaged gradient, so
        # the update would no longer be the global-batch mean's: refuse rather than mis-split.
        if accum == 1:
            return f"global_batch_size {b} is not divisible by the world size {world}"
        return (
            f"global_batch_size {b} is not divisible by the world size {world} x "
            f"engine.grad_accumulation_steps {accum} = {world * accum} (equal micro-batches on every rank)"
        )

    @model_validator(mode="after")
    def _cross_field_rules(self) -> JobSpec:
        # Rules across fields live here, on the model, so that every reader of a spec (the API at
        # submit, the engine reading spec.json) applies the same ones; each error keeps its field path.
        errors: list[InitErrorDetails] = []

        def refuse(loc: tuple[str | int, ...], reason: str, value: Any, kind: str = "value_error") -> None:
            # The reason goes in as context, not as the template: it may contain braces.
            errors.append(
                {
                    "type": PydanticCustomError(kind, "{reason}", {"reason": reason}),
                    "loc": loc,
                    "input": value,
                }
            )

        given = [k for k in ("recipe", "entrypoint", "command") if getattr(self, k) is not None]
        if len(given) != 1:
            refuse(
                ("recipe",), "exactly one of 'recipe', 'entrypoint' or 'command' must be given", self.recipe
            )
        if self.code is not None and self.recipe is not None:
            refuse(("code",), "uploaded code runs with an 'entrypoint' or a 'command', not a recipe", None)
        wanted = self.environment.requirements_file if self.environment is not None else None
        if wanted is not None and self.code is None:
            no_code = "a requirements_file is read from the uploaded 'code', and this job has none"
            refuse(("environment", "requirements_file"), no_code, wanted)
        if self.recipe is not None and self.recipe not in RECIPES:
            refuse(
                ("recipe",),
                f"unknown recipe {self.recipe!r}; known: {', '.join(sorted(RECIPES))}",
                self.recipe,
            )
        # A command splits its batches itself; the engine's rule is for the engine's split.
        if self.command is None and (reason := self._uneven_batch(self.world_size)) is not None:
            refuse(("hyperparameters", "global_batch_size"), reason, self.hyperparameters.global_batch_size)
        self._evaluation_rules(refuse)
        data_rules(
            self.data,
            device=self.resources.device,
            recipe=self.recipe,
            recipe_params=self.recipe_params,
            has_command=self.command is not None,
            evaluating=self.evaluation is not None,
            refuse=refuse,
        )
        engine = self.engine
        if engine.compile and self.world_size > 1 and engine.bucket_cap_mb < 1:
            # DDP's first bucket is 1 MiB and torch.compile's DDPOptimizer needs the others no smaller.
            refuse(
                ("engine", "bucket_cap_mb"),
                "engine.compile needs buckets of at least 1 MiB at world size > 1 (DDP's first bucket)",
                engine.bucket_cap_mb,
            )
        if (model := RECIPES.get(self.recipe or "")) is not None:
            try:
                model.model_validate(self.hyperparameters.model_extra or {})
            except ValidationError as exc:
                for e in exc.errors():
                    msg = e["msg"]
                    if e["type"] == "extra_forbidden":
                        msg = f"not a hyperparameter of recipe {self.recipe!r}"
                    refuse(("hyperparameters", *e["loc"]), msg, e.get("input"), e["type"])
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def _evaluation_rules(self, refuse: Any) -> None:
        if self.evaluation is not None and self.command is not None:
            refuse(
                ("evaluation",),
                "a command evaluates on its own: report its figures with "
                "dptrain.report(step, **{'eval/loss': ...})",
                None,
            )
        best = self.checkpoint.keep_best
        if best is None:
            return
        if self.evaluation is None:
            reason = "keep_best needs 'evaluation' (it ranks evaluation figures)"
            refuse(("checkpoint", "keep_best"), reason, None)
        known = EVAL_METRICS.get(self.recipe or "")
        if known is not None and best.metric not in known:
            refuse(
                ("checkpoint", "keep_best", "metric"),
                f"recipe {self.recipe!r} reports {', '.join(known)}, not {best.metric!r}",
                best.metric,
            )


def entrypoint_allowed(entrypoint: str, allowed_prefixes: Sequence[str]) -> bool:
    """Whether `package.module:function` lies under one of the allowed module prefixes."""
    module = entrypoint.partition(":")[0]
    return any(module == p or module.startswith(p + ".") for p in allowed_prefixes if p)
