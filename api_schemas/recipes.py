"""Built-in recipes and the cross-field checks pydantic cannot express per field."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_schemas.jobs import JobSpec


class MlpParams(BaseModel):
    """Extras of the `mlp` recipe (a small MLP classifier on deterministic synthetic data)."""

    model_config = ConfigDict(extra="forbid")

    input_size: int = Field(32, ge=1, le=65_536)
    hidden_size: int = Field(64, ge=1, le=65_536)
    num_layers: int = Field(2, ge=1, le=64)
    num_classes: int = Field(10, ge=2, le=100_000)
    dataset_size: int = Field(4096, ge=1, le=100_000_000)


class CnnBnParams(BaseModel):
    """Extras of the `cnn_bn` recipe (a small conv net with BatchNorm on deterministic synthetic images)."""

    model_config = ConfigDict(extra="forbid")

    image_size: int = Field(8, ge=4, le=1024)
    channels: int = Field(3, ge=1, le=64)
    num_classes: int = Field(10, ge=2, le=100_000)
    dataset_size: int = Field(1024, ge=1, le=100_000_000)


class LstmLmParams(BaseModel):
    """Extras of the `lstm_lm` recipe (an LSTM language model on a deterministic synthetic Markov chain)."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(64, ge=2, le=1_000_000)
    embed_size: int = Field(32, ge=1, le=65_536)
    hidden_size: int = Field(64, ge=1, le=65_536)
    num_layers: int = Field(1, ge=1, le=64)
    seq_len: int = Field(16, ge=1, le=65_536)
    dataset_size: int = Field(1024, ge=1, le=100_000_000)


class PartialFcParams(BaseModel):
    """Extras of the `partial_fc` recipe (an MLP backbone and a classifier sharded across ranks)."""

    model_config = ConfigDict(extra="forbid")

    input_size: int = Field(32, ge=1, le=65_536)
    hidden_size: int = Field(64, ge=1, le=65_536)
    embedding_size: int = Field(16, ge=1, le=65_536)
    num_classes: int = Field(64, ge=2, le=100_000_000, description="Classifier rows, split across ranks.")
    sample_rate: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Share of classes given logits per step: the batch's positives, then random negatives.",
    )
    dataset_size: int = Field(2048, ge=1, le=100_000_000)


class SparseEmbeddingParams(BaseModel):
    """Extras of the `sparse_embedding` recipe (a sparse-gradient EmbeddingBag over Zipf-skewed ids)."""

    model_config = ConfigDict(extra="forbid")

    num_embeddings: int = Field(1000, ge=2, le=100_000_000)
    embed_size: int = Field(16, ge=1, le=65_536)
    bag_size: int = Field(8, ge=1, le=65_536)
    hidden_size: int = Field(32, ge=1, le=65_536)
    num_classes: int = Field(4, ge=2, le=100_000)
    dataset_size: int = Field(1024, ge=1, le=100_000_000)


# Recipe name -> model of its hyperparameter extras. The engine registers the same names
# (a test keeps the two in step).
RECIPES: dict[str, type[BaseModel]] = {
    "mlp": MlpParams,
    "lstm_lm": LstmLmParams,
    "cnn_bn": CnnBnParams,
    "partial_fc": PartialFcParams,
    "sparse_embedding": SparseEmbeddingParams,
}

_BASE_HYPERPARAMETERS = {"global_batch_size", "lr", "momentum", "weight_decay", "steps", "seed"}


def _err(loc: tuple[str | int, ...], msg: str, value: Any) -> dict[str, Any]:
    return {"type": "value_error", "loc": loc, "msg": msg, "input": value}


_ENTRYPOINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def entrypoint_allowed(entrypoint: str, allowed_prefixes: Sequence[str]) -> bool:
    """Whether `package.module:function` lies under one of the allowed module prefixes."""
    module = entrypoint.partition(":")[0]
    return any(module == p or module.startswith(p + ".") for p in allowed_prefixes if p)


def spec_errors(spec: JobSpec, *, allowed_entrypoints: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Errors across fields of an otherwise valid spec, each with its field path (empty if none).

    `allowed_entrypoints` are the module prefixes user code may come from (DPTRAIN_ALLOWED_ENTRYPOINTS);
    with none, no entrypoint is accepted.
    """
    errors: list[dict[str, Any]] = []
    if (spec.recipe is None) == (spec.entrypoint is None):
        errors.append(_err(("recipe",), "exactly one of 'recipe' or 'entrypoint' must be given", spec.recipe))
    if spec.entrypoint is not None:
        if not _ENTRYPOINT.match(spec.entrypoint):
            errors.append(_err(("entrypoint",), "expected 'package.module:function'", spec.entrypoint))
        elif not entrypoint_allowed(spec.entrypoint, allowed_entrypoints):
            shown = ", ".join(allowed_entrypoints) or "none"
            errors.append(
                _err(
                    ("entrypoint",),
                    f"module is not under an allowed prefix (DPTRAIN_ALLOWED_ENTRYPOINTS: {shown})",
                    spec.entrypoint,
                )
            )
    if spec.recipe is not None and spec.recipe not in RECIPES:
        known = ", ".join(sorted(RECIPES))
        errors.append(_err(("recipe",), f"unknown recipe {spec.recipe!r}; known: {known}", spec.recipe))
    hp = spec.hyperparameters
    world = spec.world_size
    if hp.global_batch_size % world != 0:
        errors.append(
            _err(
                ("hyperparameters", "global_batch_size"),
                f"global_batch_size {hp.global_batch_size} is not divisible by the world size {world}",
                hp.global_batch_size,
            )
        )
    extras = {k: v for k, v in (hp.model_extra or {}).items() if k not in _BASE_HYPERPARAMETERS}
    params_model = RECIPES.get(spec.recipe or "")
    if params_model is not None:
        try:
            params_model.model_validate(extras)
        except ValidationError as exc:
            for e in exc.errors():
                msg = e["msg"]
                if e["type"] == "extra_forbidden":
                    msg = f"not a hyperparameter of recipe {spec.recipe!r}"
                errors.append(_err(("hyperparameters", *e["loc"]), msg, e.get("input")))
    return errors


def recipe_params(spec: JobSpec) -> dict[str, Any]:
    """The recipe's extras with defaults filled in (an entrypoint's extras are its own business)."""
    if spec.recipe not in RECIPES:
        return {}
    params_model = RECIPES[spec.recipe or ""]
    extras = {k: v for k, v in (spec.hyperparameters.model_extra or {}).items()}
    return params_model.model_validate(extras).model_dump()
