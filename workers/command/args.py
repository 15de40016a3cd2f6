"""`$(NAME)` in a command's arguments, expanded from the rank's environment as Kubernetes does.

A command runs without a shell, so `$VAR` reaches the program as written; `$(NAME)` is replaced by
the variable's value in the rank's environment (which only the rank knows: torchrun's `RANK`,
dptrain's `DPTRAIN_DATA_ROOT`, the job's `env`). As in a Kubernetes container's `args`: `$$` is one
`$` (so `$$(NAME)` is the literal `$(NAME)`), a reference to an unset variable stays as written, and
a value is never expanded again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

# `$$` (an escaped `$`) or `$(NAME)`; anything else after a `$` is left alone.
_REFERENCE = re.compile(r"\$(?:(\$)|\(([^)]*)\))")


def expand(arg: str, env: Mapping[str, str]) -> str:
    """`arg` with each `$(NAME)` set in `env` replaced by its value and each `$$` made one `$`."""

    def value(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        return env.get(m.group(2), m.group(0))

    return _REFERENCE.sub(value, arg)


def expand_command(command: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Every argument of `command` expanded from `env` (`expand`)."""
    return [expand(arg, env) for arg in command]
