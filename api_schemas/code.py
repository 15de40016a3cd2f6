"""What a job brings of its own: an uploaded code tree, a command line, environment variables."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints, WithJsonSchema

from api_schemas.base import Strict
from api_schemas.env import ENV_NAME_PATTERN, env_name_problem

SHA256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
# One argument of a command: any text but NUL (an argv entry cannot hold one).
CommandArg = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]


def _env_name(value: str) -> str:
    if (problem := env_name_problem(value)) is not None:
        raise ValueError(problem)
    return value


EnvName = Annotated[
    str,
    StringConstraints(max_length=128),
    AfterValidator(_env_name),
    # The pattern in the OpenAPI schema; the deny-list (api_schemas/env.py) only in the 422s.
    WithJsonSchema({"type": "string", "maxLength": 128, "pattern": ENV_NAME_PATTERN}),
]
EnvValue = Annotated[str, StringConstraints(max_length=32_768, pattern=r"^[^\x00]*$")]


class CodeRef(Strict):
    """An archive uploaded with `PUT /v1/code/{sha256}`: the tree an entrypoint or a command runs in."""

    sha256: SHA256 = Field(description="sha256 of the .tar.gz, lower-case hex.")
