"""Recipe registry: name -> builder(params, seed) -> Plan. Names match api_schemas.recipes.RECIPES."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

from workers.engine.recipes import cnn_bn, lstm_lm, mlp, partial_fc, sparse_embedding
from workers.engine.recipes.plan import Plan

RecipeBuilder = Callable[[Mapping[str, Any], int], Plan]

RECIPES: dict[str, RecipeBuilder] = {
    "mlp": mlp.build,
    "lstm_lm": lstm_lm.build,
    "cnn_bn": cnn_bn.build,
    "partial_fc": partial_fc.build,
    "sparse_embedding": sparse_embedding.build,
}

__all__ = ["RECIPES", "Plan", "RecipeBuilder", "get_builder", "get_recipe", "load_entrypoint"]

ALLOWED_ENTRYPOINTS_ENV = "DPTRAIN_ALLOWED_ENTRYPOINTS"


def get_recipe(name: str) -> RecipeBuilder:
    """The builder registered under `name`, or a ValueError naming the known recipes."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}") from None


def load_entrypoint(entrypoint: str, allowed: str | None = None) -> RecipeBuilder:
    """Import `package.module:function`, refusing modules outside DPTRAIN_ALLOWED_ENTRYPOINTS.

    The API refuses such a spec already; the worker checks again with its own setting, because it
    is the worker that runs the code.
    """
    prefixes = [
        p.strip()
        for p in (allowed if allowed is not None else os.environ.get(ALLOWED_ENTRYPOINTS_ENV, "")).split(",")
        if p.strip()
    ]
    module_name, sep, func_name = entrypoint.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"entrypoint {entrypoint!r} is not 'package.module:function'")
    if not any(module_name == p or module_name.startswith(p + ".") for p in prefixes):
        shown = ", ".join(prefixes) or "none"
        raise PermissionError(
            f"entrypoint {entrypoint!r} is not under an allowed prefix ({ALLOWED_ENTRYPOINTS_ENV}: {shown})"
        )
    builder = getattr(importlib.import_module(module_name), func_name, None)
    if not callable(builder):
        raise ValueError(f"entrypoint {entrypoint!r}: {module_name} has no function {func_name!r}")
    return builder  # type: ignore[no-any-return]


def get_builder(recipe: str | None, entrypoint: str | None) -> RecipeBuilder:
    """The builder of a built-in recipe or of a user's entrypoint."""
    if entrypoint is not None:
        return load_entrypoint(entrypoint)
    assert recipe is not None
    return get_recipe(recipe)
