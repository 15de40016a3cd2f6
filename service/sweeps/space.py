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

# Every integer of an int range up to this many is checked; wider ranges by their ends and a few
# points between (a divisibility rule could still fail between them: docs/api.md says so).
INT_EXHAUSTIVE = 64
# The product of the points checked, above which the sweep is refused rather than half-checked.
MAX_POINTS = 4096


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
        if hi - lo < INT_EXHAUSTIVE:
            return list(range(lo, hi + 1))
        return sorted({lo, lo + 1, (lo + hi) // 2, hi - 1, hi})
    if kind == "log_uniform":
        return sorted({float(lo), math.sqrt(lo * hi), float(hi)})
    return sorted({float(lo), (lo + hi) / 2, float(hi)})


def points(space: dict[str, dict[str, Any]]) -> tuple[int, itertools.product[tuple[Any, ...]]]:
    """How many points submit checks, and those points (one value per path, in space order)."""
    values = [candidates(dim) for dim in space.values()]
    return math.prod(len(v) for v in values), itertools.product(*values)


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
