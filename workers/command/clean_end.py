"""A clean end: a program that returned from `dptrain.finish()` and then crashed on its way out succeeded.

`finish()` returns only after every rank reached its barrier and the process group is gone: the
job's work is done. A crash after that, typically of the interpreter's exit (torch's Gloo teardown
now and then aborts with "terminate called without an active exception"), is a fault of the
teardown, and failing the job for it (or restarting it, training everything again) would be wrong.
The rank wrapper (workers.command.main) asks `after_finish` how its program ended; the warning it
gets goes to the job's timeline (workers.reporting.reporter).
"""

from __future__ import annotations

import signal
from pathlib import Path

from rank_contract.layout import RunFiles
from workers.engine.events import WarningEvent

# Signals a process raises on itself when it crashes. A signal from outside (SIGTERM, SIGKILL: a
# cancel, torchrun stopping the ranks because another failed, the OOM killer) is a stop, not the
# teardown's crash, and its exit decides as it always does.
CRASH_SIGNALS = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})


def after_finish(run_dir: Path, rank: int, returncode: int) -> WarningEvent | None:
    """The warning for `rank`'s program killed by a crash signal after `finish()`; None: its exit decides."""
    if returncode >= 0 or -returncode not in CRASH_SIGNALS:
        return None
    if not RunFiles(run_dir).finished(rank).exists():
        return None  # it crashed before its clean end: a failure like any other
    name = signal.Signals(-returncode).name
    message = (
        f"warning: rank {rank} was killed by {name} after dptrain.finish(), on its way out; "
        "its work was done, so the rank counts as succeeded"
    )
    return WarningEvent(rank=rank, message=message)
