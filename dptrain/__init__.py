"""dptrain's SDKs: `dptrain.Client` talks to the API; the functions below serve a training script.

`dptrain.Client` (dptrain/client.py, docs/sdk.md) submits, waits for, follows and downloads jobs
over HTTP, with typed errors (`dptrain.NotFound`, `dptrain.Refused`...).

The script SDK: report metrics, save and resume checkpoints, stop on cancel.

A job with `command: ["python", "train.py"]` runs your script on every rank under dptrain's
torchrun; these calls connect it to the service. Outside dptrain (no DPTRAIN_RUN_DIR, e.g. under
plain `torchrun`) each is a harmless no-op, so the same script runs anywhere::

    import dptrain

    state = dptrain.load_checkpoint()            # every rank: the newest verified checkpoint (else
                                                 # the spec's init_from one), or None
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    for step in range(start, steps):
        loss = train_step(model, optimizer)
        dptrain.report(step, loss=loss.item())   # rank 0: a metrics point; the job's progress
        if step % 100 == 0 or dptrain.should_stop():
            dptrain.save_checkpoint(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, step
            )
        if dptrain.should_stop():                # cancelled or past its deadline: leave, exit code 0
            break
    dptrain.finish()                             # every rank: barrier, then destroy the process group

`finish()` is the safe teardown (docs/sdk.md, "A clean end"): once every rank is past its barrier, a
crash of the interpreter's own exit (Gloo's teardown now and then aborts) no longer fails the job.
`with dptrain.finishing():` around the script's work calls it when the block ends without an error.

Only rank 0 (torchrun's RANK) writes: `report` and `save_checkpoint` do nothing on other ranks, so
call them on every rank. Importing this package does not import torch; saving and loading do.
Files to keep (a final model, samples) go in `dptrain.output_dir()`: they become the job's artifacts.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import index
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dptrain.errors import (
    ApiError,
    Conflict,
    DataLeftOut,
    FieldError,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    Refused,
    Unauthorized,
    Unplaceable,
    WaitTimeout,
)
from rank_contract.env import (
    CHECKPOINT_DIR_ENV,
    INIT_CHECKPOINT_ENV,
    KEEP_LAST_ENV,
    OUTPUT_DIR_ENV,
    RUN_DIR_ENV,
)
from rank_contract.layout import RunFiles

if TYPE_CHECKING:
    from dptrain.client import Client
    from dptrain.plan import BuildContext, Plan

__all__ = [
    "ApiError",
    "BuildContext",
    "Client",
    "Conflict",
    "DataLeftOut",
    "FieldError",
    "Forbidden",
    "NotFound",
    "PayloadTooLarge",
    "Plan",
    "RateLimited",
    "Refused",
    "Unauthorized",
    "Unplaceable",
    "WaitTimeout",
    "finish",
    "finishing",
    "is_active",
    "load_checkpoint",
    "output_dir",
    "report",
    "save_checkpoint",
    "should_stop",
]

# Imported on first use, so `import dptrain` in a script stays free of torch (see dptrain/plan.py),
# and a rank's `import dptrain` free of httpx.
_LAZY = {"Plan": "dptrain.plan", "BuildContext": "dptrain.plan", "Client": "dptrain.client"}


def __getattr__(name: str) -> Any:
    """`from dptrain import Plan` imports dptrain.plan (and torch) only then; `Client` likewise."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dptrain' has no attribute {name!r}")


def _default_keep_last() -> int:
    # Only when the runner left DPTRAIN_KEEP_LAST unset (it always sets it): the spec's own default.
    from api_schemas import CheckpointSpec

    return int(CheckpointSpec.model_fields["keep_last"].default)


@dataclass
class _Run:
    """This process's view of its dptrain run, built from the environment on first use."""

    run_dir: Path
    rank: int
    checkpoint_dir: Path | None
    keep_last: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The engine's EventWriter and CheckpointManager, imported on first use (never at module level:
    # the SDK sits above the worker's code and reaches into it only from inside a rank).
    events: Any = None
    checkpoints: Any = None

    def writer(self) -> Any:
        """Rank 0's event writer (opened once, kept open: a report is one line and one flush)."""
        from workers.engine.events import EventWriter

        if self.events is None:
            self.events = EventWriter(RunFiles(self.run_dir).rank_events(self.rank), self.rank)
        return self.events

    def manager(self) -> Any:
        """The checkpoint directory's manager (rank 0's sweeps temp files left by a killed save)."""
        from workers.engine.checkpoint import CheckpointManager

        if self.checkpoints is None:
            if self.checkpoint_dir is None:
                raise RuntimeError(f"{CHECKPOINT_DIR_ENV} is not set: dptrain has no checkpoint directory")
            self.checkpoints = CheckpointManager(
                self.checkpoint_dir, self.keep_last, self.rank == 0, training_state=False
            )
        return self.checkpoints


_lock = threading.Lock()
_current: tuple[tuple[Any, ...], _Run] | None = None


def _run() -> _Run | None:
    """The run this process belongs to, None outside dptrain; rebuilt if the environment changed."""
    global _current
    env = os.environ
    if not env.get(RUN_DIR_ENV):
        return None
    # The pid too: a forked child (a DataLoader worker) opens files of its own.
    key = (os.getpid(), *(env.get(name) for name in (RUN_DIR_ENV, "RANK", CHECKPOINT_DIR_ENV, KEEP_LAST_ENV)))
    with _lock:
        if _current is not None and _current[0] == key:
            return _current[1]
        if _current is not None and _current[0][0] == os.getpid() and _current[1].events is not None:
            _current[1].events.close()
        run = _Run(
            run_dir=Path(env[RUN_DIR_ENV]),
            rank=int(env.get("RANK", "0")),
            checkpoint_dir=Path(env[CHECKPOINT_DIR_ENV]) if env.get(CHECKPOINT_DIR_ENV) else None,
            keep_last=int(env.get(KEEP_LAST_ENV) or _default_keep_last()),
        )
        _current = key, run
        return run


def is_active() -> bool:
    """Whether this process runs under dptrain (the other functions are no-ops when it does not)."""
    return bool(os.environ.get(RUN_DIR_ENV))


def _metric(name: str, value: Any) -> float:
    # A bool is an int to Python, and float() takes strings: neither is a measurement.
    if isinstance(value, (bool, str, bytes)) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        raise TypeError(f"metric {name!r} must be a number, not {type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError) as exc:  # a tensor of several values raises either
        raise TypeError(f"metric {name!r} must be a number, not {type(value).__name__}") from exc


def _step(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError("step must be an int, not bool")
    return index(step)  # ints, numpy and 0-d torch integers


def report(step: int, **metrics: float) -> None:
    """Record `metrics` (numbers, 0-d tensors, numpy scalars) at `step`; on rank 0, the job's progress."""
    run = _run()
    if run is None or run.rank != 0:
        return
    from workers.engine.events import MetricsEvent

    event = MetricsEvent(step=_step(step), values={k: _metric(k, v) for k, v in metrics.items()})
    with run.lock:
        run.writer().emit(event)


def save_checkpoint(state: Mapping[str, Any], step: int) -> str | None:
    """Save `state` (torch.save-able, loadable with weights_only) as the checkpoint of `step`.

    Written atomically with its checksums by rank 0, which keeps the newest `keep_last` of the
    job's; returns the file's path there, None on other ranks and outside dptrain.
    """
    run = _run()
    if run is None or run.rank != 0:
        return None
    with run.lock:
        # Announced before the older checkpoints are pruned: a kill in between never leaves the
        # job's list naming files that are gone (CheckpointManager.save).
        saved = run.manager().save(_step(step), state, announce=run.writer().emit)
        assert saved is not None  # rank 0, and every step is due (every_steps=1)
    return str(saved.path)


def load_checkpoint() -> dict[str, Any] | None:
    """The newest checkpoint of this job that verifies (older ones if it does not), None if none.

    On every rank. Loaded like `torch.load(path, weights_only=True, map_location="cpu")`; raises
    when checkpoints exist but none verifies, rather than start over and prune them. A job whose
    spec names `init_from` and that has no checkpoint of its own yet gets that checkpoint (verified).
    """
    run = _run()
    if run is None:
        return None
    with run.lock:
        loaded = run.manager().load()
    if loaded is None and (init := os.environ.get(INIT_CHECKPOINT_ENV)):
        from workers.engine.init_state import read_init

        loaded = read_init(Path(init), training_state=False)
    return None if loaded is None else loaded.state


def output_dir(default: str | os.PathLike[str] = "out") -> Path:
    """Where to write what the job keeps: its DPTRAIN_OUTPUT_DIR under dptrain, else `default`.

    One folder per job, kept across its attempts (a restarted script finds what it saved there);
    what rank 0 writes there becomes the job's artifacts. Every rank may read it.
    """
    return Path(os.environ.get(OUTPUT_DIR_ENV) or default)


def should_stop() -> bool:
    """Whether dptrain asks this run to stop (cancel or deadline): save a checkpoint and exit 0."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    return RunFiles(Path(run_dir)).stop.exists() if run_dir else False


def finish() -> None:
    """End this rank's distributed work safely: a barrier, then destroy the process group; call it last.

    On every rank, once its work is done. Harmless without a process group or outside dptrain, and
    a second call does nothing more. Under dptrain it marks the rank finished, so that a crash of
    the interpreter's exit after it (SIGABRT, SIGSEGV) is a warning in the job's timeline, not a
    failed job.
    """
    # A process group exists only where the script imported torch.distributed: a script that never
    # did gets no torch import (seconds) from here.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        # Nobody tears the group down while a peer may still have work in flight with it: a rank
        # destroying its connections under another's last collective can hang or abort that one.
        dist.barrier()
        dist.destroy_process_group()
    # What the script printed reaches its log even if the exit that follows crashes.
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        marker = RunFiles(Path(run_dir)).finished(int(os.environ.get("RANK", "0")))
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()


@contextmanager
def finishing() -> Iterator[None]:
    """`with dptrain.finishing():` runs the block, then `finish()`; an exception leaves without it.

    No barrier after an error: the other ranks may never reach theirs, and the error, not a hang in
    the teardown, is what the job must report. Also a decorator: `@dptrain.finishing()`.
    """
    yield
    finish()
