"""What the ranks and the worker agree on so that the worker can read every rank's stack.

The worker reads them in workers/reporting/stacks.py.

- A rank's number, from outside: a CPU engine rank is forked from the warm agent
  (workers/engine/agent.py), and the RANK torchrun sets in it never reaches /proc/PID/environ,
  which keeps the agent's environment. Its process name (/proc/PID/comm) does: `dptrain-r3`.
- A collective's timeout (Gloo's transport, NCCL's watchdog): the rank that hit it waits, a few
  seconds at most, for its node's worker to dump the others (rank_contract.layout's
  `RunFiles.stacks_taken`) before it exits, since torchrun tears them all down as soon as one rank
  exits.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

from rank_contract.layout import RunFiles

PREFIX = "dptrain-r"
_NAME = re.compile(rf"{PREFIX}(\d+)")
_COLLECTIVE_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout|gloo.*Timed out|Timed out.*gloo", re.S
)
# How long a rank whose collective timed out waits for that dump: a dump takes a second or two, and
# a worker without py-spy writes the file at once.
AWAIT_DUMP_SECONDS = 10.0


def name_this_rank(rank: int) -> None:
    """Name this process after its rank; nothing happens where the kernel does not allow it."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(f"{PREFIX}{rank}")


def rank_of(name: str) -> int | None:
    """The rank a process name written by `name_this_rank` says, else None."""
    m = _NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def collective_timed_out(message: str) -> bool:
    """Whether a rank's error message is NCCL's or Gloo's collective timeout (not any "timed out")."""
    return bool(_COLLECTIVE_TIMEOUT.search(message))


def await_dump(run_dir: str | os.PathLike[str], *, seconds: float = AWAIT_DUMP_SECONDS) -> None:
    """Wait until the worker has dumped the ranks' stacks, or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    taken = RunFiles(Path(run_dir)).stacks_taken
    while not taken.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
