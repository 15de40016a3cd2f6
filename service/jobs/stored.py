"""Reading back what a job row stores: a spec or error that no longer validates never makes a job unreadable.

A row may hold what today's models refuse: written by an older version (with `NaN` or `Infinity`,
before specs were strict), or by hand. Such a job must still be listed, shown and cancelled, and
say what is wrong with it, instead of making every page that holds it answer 500.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

from pydantic import ValidationError

from api_schemas import EnvironmentBuild, JobError, JobSpec
from rank_contract.failures import Failure

# JobError.type of a job whose stored spec cannot be run.
INVALID_SPEC = Failure.INVALID_SPEC
# Passes of leaving out the fields that fail: leaving some out can bring up errors they hid (a
# model's own checks run only once its fields validate).
_SALVAGE_PASSES = 3
_MAX_MESSAGE = 1000


def describe(exc: ValidationError, *, limit: int = 3) -> str:
    """The first few errors of `exc` as `field.path: message`, for a JobError or a timeline reason."""
    errors = exc.errors(include_url=False, include_input=False)
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in errors[:limit]]
    more = f" (and {len(errors) - limit} more)" if len(errors) > limit else ""
    return ("; ".join(parts) + more)[:_MAX_MESSAGE]


def shown_spec(stored: Any, *, name: str) -> tuple[JobSpec, str | None]:
    """The spec the API shows for a row, and why the stored one does not validate (None when it does).

    The fields that fail are left out, so their defaults show in their place: everything else of the
    job stays visible, and the caller puts the reason into the job's `error`.
    """
    try:
        return JobSpec.model_validate(stored), None
    except ValidationError as exc:
        problem = f"the stored spec does not validate: {describe(exc)}"
        return _salvaged(stored, exc, name=name), problem


def _salvaged(stored: Any, exc: ValidationError, *, name: str) -> JobSpec:
    value = copy.deepcopy(stored) if isinstance(stored, dict) else {"name": name}
    for _ in range(_SALVAGE_PASSES):
        for error in exc.errors(include_url=False, include_input=False):
            _drop(value, error["loc"])
        try:
            return JobSpec.model_validate(value)
        except ValidationError as again:
            exc = again
    # Built without validation, from the defaults and the job's name column: what cannot fail.
    return JobSpec.model_construct(name=name)


def _drop(value: Any, loc: tuple[int | str, ...]) -> None:
    """Delete the item at `loc` inside nested dicts and lists, if it is there."""
    if loc[-1:] == ("[key]",):
        loc = loc[:-1]  # a refused dict key (an `env` name): the item it names goes
    if not loc:
        return  # the spec as a whole: nothing to leave out
    *path, last = loc
    # A key that is not there (a union's branch name, an item gone already) leaves the value as it is.
    with contextlib.suppress(KeyError, IndexError, TypeError):
        for key in path:
            value = value[key]
        del value[last]


def shown_error(stored: Any) -> JobError | None:
    """The job's error as stored, or one saying that the stored error does not validate."""
    if not stored:
        return None
    try:
        return JobError.model_validate(stored)
    except ValidationError as exc:
        message = f"the stored error does not validate ({describe(exc)}): {stored!r}"
        return JobError(type=Failure.INVALID_ERROR, message=message[:_MAX_MESSAGE])


def shown_environment(stored: Any) -> EnvironmentBuild | None:
    """How the current attempt has its environment, as stored; None if none is or it does not validate."""
    if not stored:
        return None
    try:
        return EnvironmentBuild.model_validate(stored)
    except ValidationError:
        return None  # written by the worker alone; an older or damaged record is just not shown


def shown_metrics(stored: Any) -> dict[str, float]:
    """The latest value of each metric, leaving out anything that is not a number."""
    if not isinstance(stored, dict):
        return {}
    return {str(k): v for k, v in stored.items() if type(v) in (int, float)}
