"""Starting a job from its `init_from` checkpoint (another job's, pinned and verified by the worker).

Only when the job has no checkpoint of its own: those always win (a restart of a job that started
from another continues from its own). With `init_from.resume` the whole training state is taken
(model, optimizer, LR schedule, data position, RNG, ITER and the best so far): the run continues the
source's exactly, its spec's `steps` counted from the source's step. Without it only the model's
weights are: a fine-tune, whose optimizer, data and ITER start fresh under the job's own seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from api_schemas import JobSpec
from workers.engine.checkpoint import CheckpointManager, LoadedCheckpoint, step_of
from workers.engine.distributed import DistEnv
from workers.engine.sharded_params import slice_state


class Trainer(Protocol):
    """What of workers.engine.trainer.Trainer starting from a checkpoint reads and calls."""

    @property
    def spec(self) -> JobSpec: ...
    @property
    def env(self) -> DistEnv: ...
    @property
    def model(self) -> Any: ...
    @property
    def optimizer(self) -> Any: ...
    @property
    def sharded(self) -> Sequence[str]: ...
    @property
    def optim_names(self) -> Sequence[str]: ...
    @property
    def iter(self) -> int: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def read_init(path: Path, *, training_state: bool) -> LoadedCheckpoint:
    """Read and verify (against its sidecar) the checkpoint file at `path`; raises if it does not."""
    step = step_of(path)
    if step is None:
        raise ValueError(f"init_from: {path.name} is not a checkpoint file's name")
    # is_main=False: a reader only, which writes nothing into the read-only pinned folder.
    reader = CheckpointManager(path.parent, keep_last=1, is_main=False, training_state=training_state)
    return reader.read(step)


def start_from_init(trainer: Trainer, path: Path) -> int:
    """Load the init checkpoint on this rank (every rank reads the same file); returns the ITER it sets."""
    loaded = read_init(path, training_state=True)
    init = trainer.spec.init_from
    resume = init is not None and init.resume
    try:
        if resume:
            trainer.load_state_dict(loaded.state)
        else:
            _load_weights(trainer, loaded.state["model"])
    except (RuntimeError, KeyError) as exc:
        # Another model's (or optimizer's) state: the same file fails the same way at every restart,
        # and a ValueError is not retried (workers/attempt/end.py). No collective runs in here.
        raise ValueError(f"init_from: {path.name} does not fit this job's plan: {exc}") from exc
    how = "continuing" if resume else "fine-tuning: model weights only"
    print(f"started from init_from {loaded.path} (step {loaded.step}; {how}; iter {trainer.iter})")
    return trainer.iter


def _load_weights(trainer: Trainer, full: dict[str, Any]) -> None:
    """Restore the model's weights alone from a checkpoint's full `model` state (any world size)."""
    fresh = trainer.optimizer.state_dict()  # holds no tensors before the first step: slicing changes nothing
    model, _ = slice_state(
        full,
        fresh,
        sharded=trainer.sharded,
        optim_names=trainer.optim_names,
        world_size=trainer.env.world_size,
        rank=trainer.env.rank,
    )
    trainer.model.load_state_dict(model)
