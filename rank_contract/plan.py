"""What your entrypoint returns: the model, the data, and how a step computes its loss.

An entrypoint is `package.module:function`, called on every rank as `build(hyperparameters, seed)`
or, if it takes a third argument, `build(hyperparameters, seed, ctx)` with a `BuildContext`::

    from dptrain import BuildContext, Plan

    def build(hp, seed, ctx: BuildContext) -> Plan:
        model = GPT(GPTConfig(block_size=hp["block_size"]))
        return Plan(
            model=model,
            dataset=TokenWindows(...),               # items: (idx, targets)
            compute_loss=lambda model, batch: model(*batch)[1],   # forward(idx, targets) -> (logits, loss)
            optimizer=lambda model: model.configure_optimizers(0.1, hp["lr"], (0.9, 0.95), ctx.device.type),
            eval_dataset=TokenWindows(..., split="val"),
        )

docs/engine.md walks through each convention. Users import these from `dptrain`; the engine from
here (rank_contract sits below both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

# `optimizer(params)` or `optimizer(model)`: see `Plan` for which one the engine calls.
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
# name -> (sum, count): figures the engine adds up over every eval batch on every rank, then divides.
EvalFigures = Mapping[str, tuple[torch.Tensor | float, torch.Tensor | float]]

__all__ = ["BatchDataset", "BuildContext", "EvalFigures", "OptimizerFactory", "Plan", "SchedulerFactory"]


class BatchDataset(Protocol):
    """A dataset that gathers a batch itself (the built-in recipes' in-memory tensors)."""

    def __len__(self) -> int: ...

    def batch(self, indices: torch.Tensor, device: torch.device) -> Any: ...


@dataclass(frozen=True)
class BuildContext:
    """Where the plan will run; the third argument of a builder that takes one."""

    device: torch.device
    world_size: int
    rank: int
    local_batch_size: int  # samples per rank and optimizer step (before gradient accumulation)
    # The spec's `data.train` / `data.eval`, opened under the data root (dptrain.data): "train", "eval".
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    """A built recipe or entrypoint.

    - `model`: an nn.Module, built the same on every rank (the engine seeds the RNG first and DDP
      broadcasts rank 0's weights anyway). The engine moves it to the device.
    - `dataset`: a map-style dataset (items are tensors, tuples or dicts of tensors, collated by
      `collate_fn` or torch's `default_collate`) or anything with `batch(indices, device)`; the
      engine decides which indices every rank reads, loads them through torch's DataLoader (the
      spec's `data` options) and moves each batch to the device whole. Or a `dptrain.data.Stream`
      for data that can only be read in order. See dptrain.data for files under the data root.
    - How a step gets its loss, exactly one of:
      - `loss_fn(outputs, targets)`: the batch is `(inputs, targets)` and the loss is
        `loss_fn(model(inputs), targets)`;
      - `compute_loss(model, batch)`: for models that take several inputs or return their own loss
        (nanoGPT's `forward(idx, targets) -> (logits, loss)`). Call `model(...)`, not one of its
        methods: during training it is the DDP wrapper, whose forward starts the gradient sync.
      Either must return the MEAN loss over the samples of the batch it is given.
    - `optimizer`: a factory; the engine calls `optimizer(model)` when its first parameter is named
      `model` or annotated as an `nn.Module` (parameter groups, e.g. decay/no-decay), and
      `optimizer(model.parameters())` otherwise. Default: SGD with the spec's lr, momentum and
      weight decay.
    - `lr_scheduler`: a factory `optimizer -> scheduler`, stepped once per optimizer step.
    - `eval_dataset`: held-out data in the same form as `dataset`, for the spec's `evaluation`.
    - `eval_metrics(outputs, batch) -> {name: (sum, count)}`: extra figures, reported as
      `eval/<name>` = total sum / total count over the eval set. `outputs` is `model(inputs)` with
      `loss_fn`; with `compute_loss` it is the model itself (in eval mode, under no_grad).
    - `non_data_parallel`: names (as in `model.named_parameters()` / buffers) that each rank keeps
      to itself: left out of the gradient allreduce and of the initial broadcast.
    - `sharded`: names of parameters split by rows across ranks: each rank's model holds only its
      rows; never data-parallel; checkpoints hold the whole tensor.
    - `checkpoint_modules`: with `engine.activation_checkpointing`, which submodules recompute their
      activations in backward (a predicate, outermost match wins); None for the engine's default.
    """

    model: nn.Module
    dataset: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    compute_loss: Callable[[nn.Module, Any], torch.Tensor] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    optimizer: OptimizerFactory | None = None
    lr_scheduler: SchedulerFactory | None = None
    eval_dataset: Any = None
    eval_metrics: Callable[[Any, Any], EvalFigures] | None = None
    non_data_parallel: Sequence[str] = ()
    sharded: Sequence[str] = ()
    checkpoint_modules: Callable[[nn.Module], bool] | None = None

    def __post_init__(self) -> None:
        if (self.loss_fn is None) == (self.compute_loss is None):
            raise ValueError(
                "a Plan takes exactly one of loss_fn(outputs, targets) or compute_loss(model, batch)"
            )
