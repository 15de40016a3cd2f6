"""What a recipe or a user's entrypoint hands the trainer."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class BatchDataset(Protocol):
    """A dataset that gathers a batch itself (the built-in recipes' in-memory tensors)."""

    def __len__(self) -> int: ...

    def batch(self, indices: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Plan:
    """A built recipe or entrypoint.

    - `model`: an nn.Module, built the same on every rank (the engine seeds the RNG first and DDP
      broadcasts rank 0's weights anyway).
    - `dataset`: a map-style dataset whose item is `(input, target)` or anything with
      `batch(indices, device)`; the engine decides which indices every rank reads.
    - `loss_fn(outputs, targets)`: must return the MEAN loss over the batch it is given.
    - `optimizer`: a factory `params -> Optimizer`; default SGD with the spec's lr, momentum and
      weight decay.
    - `lr_scheduler`: a factory `optimizer -> scheduler`, stepped once per optimizer step.
    - `non_data_parallel`: names (as in `model.named_parameters()` / buffers) that each rank keeps
      to itself: left out of the gradient allreduce and of the initial broadcast.
    - `sharded`: names of parameters split by rows across ranks (`workers.engine.sharding.shard_range`):
      each rank's model holds only its rows; never data-parallel; checkpoints hold the whole tensor.
    - `checkpoint_modules`: with `engine.activation_checkpointing`, which submodules recompute their
      activations in backward (a predicate, outermost match wins); None for the engine's default (see
      `workers.engine.memory.checkpoint_activations`).
    """

    model: nn.Module
    dataset: Any
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: OptimizerFactory | None = None
    lr_scheduler: SchedulerFactory | None = None
    non_data_parallel: Sequence[str] = ()
    sharded: Sequence[str] = ()
    checkpoint_modules: Callable[[nn.Module], bool] | None = None
