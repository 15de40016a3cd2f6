"""A limit on what a running job leaves on disk, checked every few seconds while its ranks run.

The outputs' and the checkpoint folder's caps (workers/attempt/outputs.py,
workers/attempt/checkpoint_cap.py) walk a folder the ranks are writing: too costly for every tick of
the watch loop, so each look is spaced by `every` seconds, and once over a limit the attempt stays
over (the ranks are being stopped).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from api_schemas import JobError


class PeriodicCheck:
    """`check` run at most every `every` seconds; its first error is kept."""

    def __init__(
        self,
        check: Callable[[], JobError | None],
        *,
        every: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.check, self.every, self.clock = check, every, clock
        self.error: JobError | None = None
        self._next = clock() + every

    def over(self) -> bool:
        """Whether the limit was passed (measured when due; once over, always over)."""
        if self.error is None and self.clock() >= self._next:
            self._next = self.clock() + self.every
            with contextlib.suppress(OSError):  # a folder being rewritten: the next look, or the end's
                self.error = self.check()
        return self.error is not None
