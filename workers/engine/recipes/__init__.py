"""Recipe registry: name -> builder(params, seed) -> Plan. Names match api_schemas.recipes.RECIPES."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from workers.engine.recipes import mlp
from workers.engine.recipes.plan import Plan

RecipeBuilder = Callable[[Mapping[str, Any], int], Plan]

RECIPES: dict[str, RecipeBuilder] = {"mlp": mlp.build}

__all__ = ["RECIPES", "Plan", "RecipeBuilder", "get_recipe"]


def get_recipe(name: str) -> RecipeBuilder:
    """The builder registered under `name`, or a ValueError naming the known recipes."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}") from None
