"""A job's own Python packages: `environment`, built by the worker into a venv layered over its own.

The spec's model checks the shape (one of the two forms, bounded lines, no control characters);
which requirements a server accepts (PEP 508 parsing, the packages that always come from the worker,
pip options) is service.jobs.requirements', which the API (422 at submit) and the worker (before a
build) both apply: it needs the PyPA's `packaging`, which these models, read by the light client
and the engine, do not import.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints, model_validator

from api_schemas.base import Strict

MAX_REQUIREMENTS = 200
MAX_REQUIREMENT_LENGTH = 1000
# One requirement line: printable text, no line breaks (one line is one requirement), no NUL.
RequirementLine = Annotated[
    str,
    StringConstraints(
        min_length=1, max_length=MAX_REQUIREMENT_LENGTH, strip_whitespace=True, pattern=r"^[^\x00-\x1f\x7f]+$"
    ),
]


def _inside_code(value: str) -> str:
    if value.startswith("/") or ".." in value.split("/"):
        raise ValueError("expected a relative path inside the uploaded code (no leading '/', no '..')")
    return value


# A path inside the uploaded code tree: relative, no `..`, plain characters.
RequirementsPath = Annotated[
    str,
    StringConstraints(min_length=1, max_length=512, pattern=r"^[A-Za-z0-9_.\-/]+$"),
    AfterValidator(_inside_code),
]


class EnvironmentSpec(Strict):
    """The job's packages, installed on top of the worker's (torch, numpy and dptrain always the worker's)."""

    requirements: list[RequirementLine] | None = Field(
        None,
        min_length=1,
        max_length=MAX_REQUIREMENTS,
        description="PEP 508 requirement lines, e.g. `einops==0.8.0`, `transformers>=4.40,<5`.",
    )
    requirements_file: RequirementsPath | None = Field(
        None,
        description="A requirements file in the uploaded `code` tree (a relative path), read by the worker.",
    )

    @model_validator(mode="after")
    def _one_form(self) -> EnvironmentSpec:
        if (self.requirements is None) == (self.requirements_file is None):
            raise ValueError("give exactly one of 'requirements' or 'requirements_file'")
        return self
