"""Checkpoint file names (`ckpt-{step:09d}.pt`) and the step a name stands for, defined once.

The engine and the SDK write these names, the worker and the API derive a checkpoint's file from
its job and step with them: a path is never taken from what a job reports. Torch-free and cheap.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["MAX_STEP", "checkpoint_name", "step_of"]

# ASCII digits only (`\d` takes any Unicode digit), matched whole (`$` also matches before a newline).
_NAME = re.compile(r"ckpt-([0-9]{9})\.pt")
MAX_STEP = 10**9 - 1  # the most nine digits hold


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint taken after `step` optimizer steps."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"no checkpoint name for step {step}: steps run from 0 to {MAX_STEP}")
    return f"ckpt-{step:09d}.pt"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The step of a checkpoint file's name; None for any other file (sidecars and temp files included)."""
    m = _NAME.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None
