"""Bounds of path and query parameters, as Annotated aliases routes combine with `Path()` or `Query()`.

Every integer a client sends is bounded by the column it is compared with: beyond it the query
fails instead of matching nothing (PostgreSQL: "bigint out of range" or "integer out of range" for
the bound parameter; sqlite3 cannot bind an int past 64 bits), a 500 where a 422 naming the
parameter is due.
"""

from __future__ import annotations

from typing import Annotated

from annotated_types import Le
from fastapi import Path
from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

from api_schemas.base import INT64_MAX
from service.strict_json import NUL_MESSAGE, STRING_NUL

# INT64_MAX: PostgreSQL's bigint and SQLite's INTEGER, for row ids, steps and cursors.
# PostgreSQL's integer: `log_lines.rank`.
INT32_MAX = 2**31 - 1

Int64 = Annotated[int, Le(INT64_MAX)]
Int32 = Annotated[int, Le(INT32_MAX)]


def _no_nul(value: str) -> str:
    if "\x00" in value:
        # PostgreSQL refuses NUL in any text it is given, even only to compare.
        raise PydanticCustomError(STRING_NUL, NUL_MESSAGE)
    return value


def _relative_path(value: str) -> str:
    if value.startswith("/") or any(part in ("", ".", "..") for part in value.split("/")):
        raise PydanticCustomError("relative_path", "must be a relative path without '.', '..' or empty parts")
    return value


# A name or id from the path or the query string.
Text = Annotated[str, AfterValidator(_no_nul)]
JobId = Annotated[Text, Path(description="The job's id.")]
CheckpointId = Annotated[Int64, Path(ge=1, description="The checkpoint's id.")]
UserPath = Annotated[Text, Path(description="The user's name.")]
ArtifactPath = Annotated[
    Text,
    AfterValidator(_relative_path),
    Path(description="The artifact's path, relative to the job's DPTRAIN_OUTPUT_DIR."),
]
