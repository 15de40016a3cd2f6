"""Test-only fault injection via DPTRAIN_FAULT_INJECT (not part of the wire contract).

Format: `ACTION[:rank=R][:step=S][:code=C][:ms=M]`, e.g. `raise:rank=1:step=3`.
  raise -> RuntimeError("injected fault at step S") at the start of step S (S = ITER before the step)
  exit  -> os._exit(C) (default 3) there instead, i.e. a crash that leaves no error event
  hang  -> sleep forever there, i.e. a rank that never joins the next collective
  sleep -> sleep M milliseconds (default 100) there and go on: a slow job that fault tests can
           interrupt at a chosen step (without step=, every step is slowed; the math is unchanged)
A missing rank or step matches every rank or step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ENV_VAR = "DPTRAIN_FAULT_INJECT"


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    action: str
    rank: int | None = None
    step: int | None = None
    code: int = 3
    ms: int = 100

    def __post_init__(self) -> None:
        if self.action not in ("raise", "exit", "hang", "sleep"):
            raise ValueError(
                f"{ENV_VAR}: unknown action {self.action!r} (use 'raise', 'exit', 'hang' or 'sleep')"
            )

    def maybe_fire(self, rank: int, step: int) -> None:
        """Fire if this fault targets (rank, step)."""
        if (self.rank is None or self.rank == rank) and (self.step is None or self.step == step):
            if self.action == "exit":
                os._exit(self.code)
            if self.action == "sleep":
                time.sleep(self.ms / 1000)
                return
            if self.action == "hang":
                while True:
                    time.sleep(3600)
            raise RuntimeError(f"injected fault at step {step}")


def parse_fault(value: str | None) -> Fault | None:
    """Parse the env var's value; empty or None means no fault."""
    if not value:
        return None
    action, *pairs = value.strip().split(":")
    opts: dict[str, int] = {}
    for pair in pairs:
        key, sep, num = pair.partition("=")
        if not sep or key not in ("rank", "step", "code", "ms"):
            raise ValueError(f"{ENV_VAR}: bad field {pair!r} in {value!r}")
        opts[key] = int(num)
    return Fault(action=action, **opts)


def fault_from_env() -> Fault | None:
    """The fault configured in the environment, if any."""
    return parse_fault(os.environ.get(ENV_VAR))
