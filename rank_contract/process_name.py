"""The name a rank gives its process, where the worker reads its rank from outside (workers/stacks.py).

A CPU engine rank is forked from the warm agent (workers/engine/agent.py): the RANK torchrun sets in
it never reaches /proc/PID/environ, which keeps the agent's environment. Its process name
(/proc/PID/comm, at most 15 bytes) does: `dptrain-r3`.
"""

from __future__ import annotations

import contextlib
import re

PREFIX = "dptrain-r"
_NAME = re.compile(rf"{PREFIX}(\d+)")


def name_this_rank(rank: int) -> None:
    """Name this process after its rank; nothing happens where the kernel does not allow it."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(f"{PREFIX}{rank}")


def rank_of(name: str) -> int | None:
    """The rank a process name written by `name_this_rank` says, else None."""
    m = _NAME.fullmatch(name)
    return int(m.group(1)) if m else None
