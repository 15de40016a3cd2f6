"""A job's checkpoint folder against DPTRAIN_MAX_CHECKPOINT_BYTES_PER_JOB, while its ranks run and at the end.

Like the outputs (workers/attempt/outputs.py): a walk that follows no link, every few seconds while the
ranks run and again at the attempt's end; past the cap the ranks are stopped and the job fails with
CheckpointTooLarge, which a restart would only meet again (rank_contract/failures.py).

Everything in the folder counts, not only checkpoints: sidecars, temp files of a save, a best
marker, and whatever junk the ranks write there, folders and links included. Each entry counts
the larger of its size and the blocks it holds on disk: its size, because a sparse file costs its
full size once copied, downloaded or pinned onto another file system (and a hole-punched file is
still that size to every reader); its blocks, because `fallocate --keep-size` takes disk without
growing the size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from api_schemas import JobError
from rank_contract.failures import Failure
from workers.attempt.outputs import CHECK_SECONDS, size_text
from workers.attempt.periodic_check import PeriodicCheck

SETTING = "DPTRAIN_MAX_CHECKPOINT_BYTES_PER_JOB"


def measure(directory: Path, *, cap: int) -> int:
    """Bytes `directory` holds (see the module's docstring), stopping early once past `cap`."""
    total = 0
    # A folder a rank made unreadable to a worker that is not root: what it holds is not seen; a
    # root worker (the production case, ranks as another user) reads every folder.
    for root, dirs, files in os.walk(directory, followlinks=False):
        for name in (*dirs, *files):
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:
                continue  # gone since the listing
            total += max(info.st_size, info.st_blocks * 512)
            if total > cap:
                return total
    return total


def over_cap(directory: Path, *, cap: int) -> JobError | None:
    """CheckpointTooLarge's error when `directory` holds more than `cap` bytes, else None."""
    held = measure(directory, cap=cap)
    if held <= cap:
        return None
    message = (
        f"the job's checkpoint folder holds at least {size_text(held)}, "
        f"over the {size_text(cap)} cap ({SETTING})"
    )
    return JobError(type=Failure.CHECKPOINT_TOO_LARGE, message=message)


class CheckpointGuard(PeriodicCheck):
    """The check of a running job's checkpoint folder against its cap, at most every `every` seconds."""

    def __init__(
        self,
        directory: Path,
        *,
        cap: int,
        every: float = CHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory, self.cap = directory, cap
        super().__init__(lambda: over_cap(self.directory, cap=self.cap), every=every, clock=clock)

    def at_end(self) -> JobError | None:
        """Measure once more after the ranks are gone: what the attempt leaves behind."""
        if self.error is None:
            try:
                self.error = self.check()
            except OSError:
                return None
        return self.error
