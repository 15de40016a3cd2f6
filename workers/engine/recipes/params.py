"""Base of each built-in recipe's extras: integer fields checked as the API checks them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

P = TypeVar("P", bound="RecipeParams")


@dataclass(frozen=True)
class RecipeParams:
    """A recipe's extras: every `int` field must be an integer >= its MINIMUMS entry (default 1).

    JSON has no int/float split, so 8.0 is accepted as 8; bool is refused although Python counts it as
    an int. Fields of other types are the subclass's to check (call super().__post_init__() first).
    """

    RECIPE: ClassVar[str] = ""
    MINIMUMS: ClassVar[Mapping[str, int]] = {}

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type not in ("int", int):
                continue
            v = getattr(self, f.name)
            if isinstance(v, float) and v.is_integer():
                v = int(v)
                object.__setattr__(self, f.name, v)
            lo = self.MINIMUMS.get(f.name, 1)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"hyperparameters.{f.name} must be an integer >= {lo}, got {v!r}")

    @classmethod
    def from_params(cls: type[P], params: Mapping[str, Any]) -> P:
        """Build from the spec's recipe extras; unknown keys are refused like the API does."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"not a hyperparameter of recipe '{cls.RECIPE}': {', '.join(unknown)}")
        return cls(**params)
