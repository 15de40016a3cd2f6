"""What every request model shares: strict JSON types, finite numbers, bounded free-form values."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict

# A free-form value (an entrypoint's own hyperparameters) may nest this deep and hold this many
# items in all: enough for any real configuration, and it keeps a hostile body from costing more
# than its size (the body limit alone allows a million one-byte levels).
MAX_JSON_DEPTH = 32
MAX_JSON_ITEMS = 10_000
# Integers are 64-bit signed wherever they end up (PostgreSQL bigint, torch's int64).
INT64_MAX = 2**63 - 1


class Strict(BaseModel):
    """Base for request models: unknown fields refused, JSON types strict, numbers finite.

    Strict because a spec is JSON: `"steps": "5"` or `"steps": true` is a client's bug to report,
    not a value to guess at. Finite because JSON has no NaN or infinity (Python's parser accepts
    both, and `1e999` overflows to inf), and the engine could do nothing sensible with them.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def check_json_value(value: Any) -> Any:
    """Accept a JSON value: finite 64-bit numbers, text without NUL, at most MAX_JSON_DEPTH levels deep."""
    # Iterative, not recursive: a deep value must be refused with a message, not a RecursionError.
    stack: list[tuple[Any, int]] = [(value, 1)]
    items = 0
    while stack:
        v, depth = stack.pop()
        items += 1
        if items > MAX_JSON_ITEMS:
            raise ValueError(f"more than {MAX_JSON_ITEMS} items in one value")
        if isinstance(v, str):
            if "\x00" in v:
                raise ValueError("strings may not contain NUL (\\u0000)")
            continue
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, int):
            if not -INT64_MAX - 1 <= v <= INT64_MAX:
                raise ValueError("integers must fit in 64 bits")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise ValueError("numbers must be finite (JSON has no NaN or infinity)")
        elif isinstance(v, (list, dict)):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
            if isinstance(v, dict):
                if not all(isinstance(k, str) and "\x00" not in k for k in v):
                    raise ValueError("object keys must be strings without NUL")
                stack.extend((x, depth + 1) for x in v.values())
            else:
                stack.extend((x, depth + 1) for x in v)
        else:
            raise ValueError(f"not a JSON value: {type(v).__name__}")
    return value


JsonValue = Annotated[Any, AfterValidator(check_json_value)]

# A job's `priority` is within +-MAX_PRIORITY; an admin may submit up to it, a user up to what an
# admin granted (`max_priority`, at most this too).
MAX_PRIORITY = 1000
