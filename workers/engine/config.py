"""Engine configuration: the job spec (a plain JSON dict) turned into validated dataclasses."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

# The hyperparameters every recipe shares; anything else in `hyperparameters` belongs to the recipe.
BASE_HYPERPARAMETERS = frozenset({"global_batch_size", "lr", "momentum", "weight_decay", "steps", "seed"})

# Autocast compute dtypes the engine supports; params and optimizer state always stay fp32.
PRECISIONS = ("fp32", "bf16")

# How BatchNorm-style buffers (running stats) stay consistent across ranks; see EngineConfig.buffers.
BUFFER_MODES = ("broadcast", "average")

# How replicas stay in step: gradient allreduce every step, or LocalSGD's periodic parameter averaging.
MODES = ("allreduce", "local_sgd")

# How sparse gradients (nn.Embedding(sparse=True)) are synchronised; see EngineConfig.sparse.
SPARSE_MODES = ("allgather", "dense")


def _int(section: str, name: str, value: Any, lo: int, hi: int | None = None) -> int:
    # JSON has no int/float split and bool is an int subclass in Python: be explicit so a
    # `true` or `3.5` never becomes a batch size.
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{section}.{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{section}.{name} must be {bounds}, got {value}")
    return value


def _float(section: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{section}.{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TrainingConfig:
    """Optimisation settings shared by all recipes."""

    global_batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    steps: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        s = "hyperparameters"
        object.__setattr__(self, "global_batch_size", _int(s, "global_batch_size", self.global_batch_size, 1))
        object.__setattr__(self, "steps", _int(s, "steps", self.steps, 1))
        object.__setattr__(self, "seed", _int(s, "seed", self.seed, 0, 2**63 - 1))
        for name in ("lr", "momentum", "weight_decay"):
            object.__setattr__(self, name, _float(s, name, getattr(self, name)))
        if self.lr <= 0:
            raise ValueError(f"hyperparameters.lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"hyperparameters.momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"hyperparameters.weight_decay must be >= 0, got {self.weight_decay}")


@dataclass(frozen=True)
class ResourcesConfig:
    """Where the ranks run, as requested by the spec (torchrun's WORLD_SIZE is what actually runs)."""

    nodes: int = 1
    processes_per_node: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", _int("resources", "nodes", self.nodes, 1))
        object.__setattr__(
            self, "processes_per_node", _int("resources", "processes_per_node", self.processes_per_node, 1)
        )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"resources.device must be 'cpu' or 'cuda', got {self.device!r}")

    @property
    def world_size(self) -> int:
        """Ranks the spec asked for."""
        return self.nodes * self.processes_per_node


@dataclass(frozen=True)
class EngineConfig:
    """Data-parallel engine options."""

    bucket_cap_mb: float = 25.0
    log_every_steps: int = 1
    collective_timeout_seconds: int = 300
    precision: str = "fp32"
    grad_accumulation_steps: int = 1
    grad_clip_norm: float | None = None
    # "average" by default: each rank's running stats see only its own shard, so averaging them after every
    # step uses all ranks' data, while "broadcast" (DDP's broadcast_buffers, Caffe2's
    # broadcast_computed_params) keeps rank 0's and throws the other world-1 ranks' stats away.
    buffers: str = "average"
    # Normalise with whole-global-batch statistics (MXNet's SyncBN) so that BatchNorm, too, computes the
    # same thing at any world size; costs collectives inside every BatchNorm forward and backward.
    sync_batchnorm: bool = False
    # "local_sgd" (Paddle's LocalSGD, Caffe2's BMUF): after `local_sgd_warmup_steps` ordinary allreduce steps,
    # each rank steps on its own gradient and parameters are averaged every `local_sgd_period` steps.
    mode: str = "allreduce"
    local_sgd_period: int = 4
    local_sgd_warmup_steps: int = 0
    # Sparse gradients: "allgather" every rank's (indices, values) (works on Gloo and NCCL, sends only the
    # touched rows) or "dense" (densify and allreduce like any other gradient).
    sparse: str = "allgather"
    # Recompute activations in backward instead of keeping them (Caffe2's memonger): less memory, more work.
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_cap_mb", _float("engine", "bucket_cap_mb", self.bucket_cap_mb))
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"engine.bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        every = _int("engine", "log_every_steps", self.log_every_steps, 1)
        object.__setattr__(self, "log_every_steps", every)
        object.__setattr__(
            self,
            "collective_timeout_seconds",
            _int("engine", "collective_timeout_seconds", self.collective_timeout_seconds, 1),
        )
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"engine.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        object.__setattr__(
            self,
            "grad_accumulation_steps",
            _int("engine", "grad_accumulation_steps", self.grad_accumulation_steps, 1),
        )
        if self.grad_clip_norm is not None:
            clip = _float("engine", "grad_clip_norm", self.grad_clip_norm)
            if clip <= 0:
                raise ValueError(f"engine.grad_clip_norm must be > 0 (or null for no clipping), got {clip}")
            object.__setattr__(self, "grad_clip_norm", clip)
        if self.buffers not in BUFFER_MODES:
            raise ValueError(f"engine.buffers must be one of {', '.join(BUFFER_MODES)}, got {self.buffers!r}")
        for flag in ("sync_batchnorm", "activation_checkpointing"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"engine.{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.mode not in MODES:
            raise ValueError(f"engine.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.sparse not in SPARSE_MODES:
            raise ValueError(f"engine.sparse must be one of {', '.join(SPARSE_MODES)}, got {self.sparse!r}")
        object.__setattr__(
            self, "local_sgd_period", _int("engine", "local_sgd_period", self.local_sgd_period, 1)
        )
        object.__setattr__(
            self,
            "local_sgd_warmup_steps",
            _int("engine", "local_sgd_warmup_steps", self.local_sgd_warmup_steps, 0),
        )


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint cadence and retention; the last step is always checkpointed."""

    every_steps: int = 100
    keep_last: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "every_steps", _int("checkpoint", "every_steps", self.every_steps, 1))
        object.__setattr__(self, "keep_last", _int("checkpoint", "keep_last", self.keep_last, 1))


def _section(spec: Mapping[str, Any], name: str, cls: type[Any]) -> Any:
    raw = spec.get(name)
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise ValueError(f"{name} must be an object, got {type(raw).__name__}")
    # Sections are strict (like the API's models) so a typo'd option never passes silently.
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown {name} option(s): {', '.join(unknown)}")
    return cls(**raw)


@dataclass(frozen=True)
class JobConfig:
    """Everything the engine needs from a job spec."""

    recipe: str | None = None
    # User code, `package.module:function` (checked against DPTRAIN_ALLOWED_ENTRYPOINTS when loaded).
    entrypoint: str | None = None
    training: TrainingConfig = field(default_factory=TrainingConfig)
    recipe_params: dict[str, Any] = field(default_factory=dict)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if (self.recipe is None) == (self.entrypoint is None):
            raise ValueError("exactly one of 'recipe' or 'entrypoint' must be given")
        for name in ("recipe", "entrypoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> JobConfig:
        """Convert a JobSpec JSON dict; keys the engine does not use (name, labels, ...) are ignored."""
        if not isinstance(spec, Mapping):
            raise ValueError(f"spec must be a JSON object, got {type(spec).__name__}")
        hp = spec.get("hyperparameters") or {}
        if not isinstance(hp, Mapping):
            raise ValueError(f"hyperparameters must be an object, got {type(hp).__name__}")
        training = TrainingConfig(**{k: v for k, v in hp.items() if k in BASE_HYPERPARAMETERS})
        extras = {k: v for k, v in hp.items() if k not in BASE_HYPERPARAMETERS}
        return cls(
            recipe=spec.get("recipe"),
            entrypoint=spec.get("entrypoint"),
            training=training,
            recipe_params=extras,
            resources=_section(spec, "resources", ResourcesConfig),
            engine=_section(spec, "engine", EngineConfig),
            checkpoint=_section(spec, "checkpoint", CheckpointConfig),
        )

    def local_batch_size(self, world_size: int) -> int:
        """Per-rank batch; refuses a batch that does not split evenly over ranks and micro-steps."""
        b = self.training.global_batch_size
        if world_size < 1 or b % world_size != 0:
            raise ValueError(f"global_batch_size {b} is not divisible by the world size {world_size}")
        local, accum = b // world_size, self.engine.grad_accumulation_steps
        # Unequal micro-batches would weight samples unequally under the 1/accum loss scaling, so the
        # update would no longer be the local-batch mean gradient: refuse rather than mis-split silently.
        if local % accum != 0:
            raise ValueError(
                f"engine.grad_accumulation_steps {accum} does not divide the local batch {local} "
                f"(global_batch_size {b} / world size {world_size})"
            )
        return local

    def to_dict(self) -> dict[str, Any]:
        """Plain (weights_only-safe) dict of the settings, stored in checkpoints for provenance."""
        t = self.training
        return {
            "recipe": self.recipe,
            "entrypoint": self.entrypoint,
            "hyperparameters": {
                "global_batch_size": t.global_batch_size,
                "lr": t.lr,
                "momentum": t.momentum,
                "weight_decay": t.weight_decay,
                "steps": t.steps,
                "seed": t.seed,
                **self.recipe_params,
            },
        }
