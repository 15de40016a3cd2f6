"""What a job brings of its own: an uploaded code tree, a command line, environment variables."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints, WithJsonSchema

from api_schemas.base import Strict

# A user's variable must not steer the loader, the interpreter, dptrain itself or torchrun's wiring:
# those decide what code runs and how the ranks find each other, not the user's program.
RESERVED_ENV_PREFIXES = ("DPTRAIN_", "LD_", "PYTHON", "TORCHELASTIC_")
RESERVED_ENV_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PATH",
    }
)


SHA256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
# One argument of a command: any text but NUL (an argv entry cannot hold one).
CommandArg = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]


def _env_name(value: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value) is None:
        raise ValueError("expected a variable name: letters, digits and '_', not starting with a digit")
    upper = value.upper()
    if upper.startswith(RESERVED_ENV_PREFIXES) or upper in RESERVED_ENV_NAMES:
        raise ValueError(
            f"{value} is reserved: DPTRAIN_*, LD_*, PYTHON*, TORCHELASTIC_*, PATH and torchrun's own "
            "variables are set by the worker"
        )
    return value


EnvName = Annotated[
    str,
    StringConstraints(max_length=128),
    AfterValidator(_env_name),
    WithJsonSchema({"type": "string", "maxLength": 128, "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"}),
]
EnvValue = Annotated[str, StringConstraints(max_length=32_768, pattern=r"^[^\x00]*$")]


class CodeRef(Strict):
    """An archive uploaded with `PUT /v1/code/{sha256}`: the tree an entrypoint or a command runs in."""

    sha256: SHA256 = Field(description="sha256 of the .tar.gz, lower-case hex.")
