"""A sweep's search space: Optuna distributions, the points checked at submit, and trial specs."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

# The product of the points checked (every choice, every integer of a range, a float range's ends
# and middle), above which the sweep is refused rather than half-checked: each point is a whole
# JobSpec validated, about 20 us, so the largest space costs a submit under half a second.
MAX_POINTS = 20_000


def distributions(space: dict[str, dict[str, Any]]) -> dict[str, BaseDistribution]:
    """Optuna's distribution for each dotted path."""
    out: dict[str, BaseDistribution] = {}
    for path, dim in space.items():
        kind, value = next(iter(dim.items()))
        if kind == "choice":
            out[path] = CategoricalDistribution(value)
        elif kind == "int":
            out[path] = IntDistribution(int(value[0]), int(value[1]))
        else:
            out[path] = FloatDistribution(float(value[0]), float(value[1]), log=kind == "log_uniform")
    return out


def grid(space: dict[str, dict[str, Any]]) -> dict[str, list[Any]]:
    """The grid sampler's values per path (choice and int dimensions only)."""
    out: dict[str, list[Any]] = {}
    for path, dim in space.items():
        kind, value = next(iter(dim.items()))
        out[path] = list(value) if kind == "choice" else list(range(int(value[0]), int(value[1]) + 1))
    return out


def candidates(dim: dict[str, Any]) -> list[Any]:
    """The values of one dimension that submit checks."""
    kind, value = next(iter(dim.items()))
    if kind == "choice":
        return list(value)
    lo, hi = value
    if kind == "int":
        # Every one: a rule such as a batch the ranks must divide can fail at any value between.
        return list(range(lo, hi + 1))
    if kind == "log_uniform":
        return sorted({float(lo), math.sqrt(lo * hi), float(hi)})
    return sorted({float(lo), (lo + hi) / 2, float(hi)})


def count(space: dict[str, dict[str, Any]]) -> int:
    """How many points submit checks (counted without listing a range's values)."""
    return math.prod(_size(dim) for dim in space.values())


def _size(dim: dict[str, Any]) -> int:
    kind, value = next(iter(dim.items()))
    if kind == "int":
        return int(value[1]) - int(value[0]) + 1
    return len(candidates(dim))


def points(space: dict[str, dict[str, Any]]) -> itertools.product[tuple[Any, ...]]:
    """The points submit checks (one value per path, in space order); call only below MAX_POINTS."""
    return itertools.product(*(candidates(dim) for dim in space.values()))


def with_params(base: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with each dotted path set to its value (missing objects made)."""
    spec = copy.deepcopy(base)
    for path, value in params.items():
        *parents, leaf = path.split(".")
        node = spec
        for part in parents:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ValueError(f"{'.'.join(parents)} is not an object in the base spec")
            node = child
        node[leaf] = value
    return spec
