"""Evaluation on the plan's eval dataset: exact sums and counts over an eval set split across ranks.

The eval set is cut, in order, into batches of a fixed size that does not depend on the world size;
batch i is evaluated by rank i % W. Each batch is computed exactly as it would be at any other world
size (same samples, same weights), every rank adds `loss * samples` and each metric's (sum, count) in
float64, and one allreduce adds the ranks' totals. So the figures are the same at 1, 2 or 3 ranks,
however unevenly the batches fall, up to the order of that last float64 sum.

Plans with sharded parameters run collectives inside their forward and loss (a model-parallel
classifier): there every rank takes part in every round, a rank without a batch left evaluating an
empty one that adds nothing.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from api_schemas import EVAL_METRIC_PATTERN, JobSpec
from rank_contract.data import Stream
from rank_contract.plan import Plan
from workers.engine import distributed
from workers.engine.batch_loader import (
    Batches,
    fixed_batch_sampler,
    loader_options,
    map_loader,
    shutdown_workers,
)
from workers.engine.batch_sampler import batch_source
from workers.engine.conventions import batch_size, check_loss, loss_and_outputs

LOSS = "eval/loss"


class Evaluator:
    """Runs one evaluation of a plan's eval dataset on every rank; returns the same figures on each."""

    def __init__(
        self,
        *,
        plan: Plan,
        dataset: Any,
        env: distributed.DistEnv,
        device: torch.device,
        batch_size: int,
        max_batches: int | None,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]],
        loader_options: dict[str, Any] | None = None,
    ) -> None:
        self.plan, self.env, self.device, self.autocast = plan, env, device, autocast
        # `batch(indices, device)` form, for the empty batches of lockstep rounds.
        self.dataset = batch_source(dataset, plan.collate_fn)
        self.batch_size = batch_size
        size = len(dataset)
        if size < 1:
            raise ValueError("the plan's eval_dataset is empty")
        batches = math.ceil(size / batch_size)
        self.batches = min(batches, max_batches) if max_batches is not None else batches
        self.size = size
        # Collectives inside the model: every rank steps through every round (see the module docstring).
        self.lockstep = bool(plan.sharded)
        # One loader for every evaluation, so persistent loader processes (data.persistent_workers)
        # stay between them; None where this rank has no batch at all.
        mine = [self._indices(i) for i in self.my_batches() if i >= 0]
        self.loader = (
            map_loader(dataset, plan.collate_fn, fixed_batch_sampler(mine), loader_options or {})
            if mine
            else None
        )

    def _indices(self, i: int) -> torch.Tensor:
        start = i * self.batch_size
        return torch.arange(start, min(start + self.batch_size, self.size), dtype=torch.long)

    def my_batches(self) -> list[int]:
        """The eval batches this rank computes (round robin), padded with -1 (empty) in lockstep mode."""
        mine = list(range(self.env.rank, self.batches, self.env.world_size))
        if self.lockstep:
            rounds = math.ceil(self.batches / self.env.world_size)
            mine += [-1] * (rounds - len(mine))
        return mine

    def run(self, model: nn.Module) -> dict[str, float]:
        """Evaluate `model` (the bare module) in eval mode without grad; back to train mode after."""
        was_training = model.training
        model.eval()  # BatchNorm on its running statistics, dropout off
        try:
            with torch.no_grad():
                totals = self._local_totals(model)
        finally:
            model.train(was_training)
        return self._reduce(totals)

    def _local_totals(self, model: nn.Module) -> dict[str, torch.Tensor]:
        # name -> float64 [sum, count] on the device; added to without a host sync per batch.
        totals: dict[str, torch.Tensor] = {LOSS: torch.zeros(2, dtype=torch.float64, device=self.device)}
        loaded = self._batches()
        try:
            self._add_up(model, totals, loaded)
        finally:
            if loaded is not None:
                loaded.close()  # this pass's loader processes, unless they persist between evaluations
        return totals

    def _add_up(self, model: nn.Module, totals: dict[str, torch.Tensor], loaded: Batches | None) -> None:
        for i in self.my_batches():
            if i >= 0:
                assert loaded is not None
                indices, batch = self._indices(i), loaded.take()
            else:
                indices = torch.empty(0, dtype=torch.long)
                batch = self.dataset.batch(indices, self.device)
            n = len(indices)
            with self.autocast():
                loss, outputs = loss_and_outputs(self.plan, model, batch)
                figures = self.plan.eval_metrics(outputs, batch) if self.plan.eval_metrics else {}
            if n == 0:
                continue  # an empty lockstep batch: it ran for the collectives, it adds nothing
            if i >= 0 and batch_size(batch) != n:
                raise ValueError(f"the eval dataset gave {batch_size(batch)} samples for {n} indices")
            totals[LOSS] += torch.stack([check_loss(loss).detach().double() * n, _f64(n, self.device)])
            for name, value in figures.items():
                key = metric_name(name)
                pair = torch.stack([_f64(v, self.device) for v in _sum_count(name, value)])
                totals[key] = totals[key] + pair if key in totals else pair

    def _batches(self) -> Batches | None:
        if self.loader is None:
            return None
        w = self.env.world_size
        return Batches(
            self.loader,
            device=self.device,
            rank=self.env.rank,
            first=self.env.rank,
            every=w,
            label="eval batch",
        )

    def close(self) -> None:
        """End persistent loader processes (the last evaluation is over)."""
        shutdown_workers(getattr(self.loader, "_iterator", None))  # kept only for persistent workers

    def _reduce(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        names = sorted(totals)
        if distributed.active(self.env):
            # Rank 0 always has batch 0, so it knows every metric name the plan reports; a rank without
            # batches knows none. Its list orders the one allreduce; a rank that saw a name rank 0 did not
            # counts itself in slot 0, so every rank raises together instead of hanging in a collective.
            shared: list[Any] = [names]
            dist.broadcast_object_list(shared, src=0)
            names = shared[0]
        unknown = [n for n in totals if n not in names]
        zero = torch.zeros(2, dtype=torch.float64, device=self.device)
        vec = torch.cat(
            [torch.tensor([float(bool(unknown))], dtype=torch.float64, device=self.device)]
            + [totals.get(n, zero) for n in names]
        )
        if distributed.active(self.env):
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
        values = vec.tolist()
        if values[0]:
            raise ValueError(
                f"eval_metrics reported names rank 0 did not ({', '.join(unknown) or 'on another rank'}; "
                f"rank 0: {', '.join(names)}): a plan must report the same names for every batch"
            )
        pairs = values[1:]
        return {n: pairs[2 * k] / pairs[2 * k + 1] for k, n in enumerate(names) if pairs[2 * k + 1] > 0}


def evaluator_for(
    *,
    spec: JobSpec,
    plan: Plan,
    env: distributed.DistEnv,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Evaluator | None:
    """The job's evaluator, or None without `evaluation`; ValueError if the plan has no eval data."""
    ev = spec.evaluation
    if ev is None:
        return None
    if plan.eval_dataset is None:
        raise ValueError("the spec asks for evaluation but the plan has no eval_dataset")
    if isinstance(plan.eval_dataset, Stream):
        raise TypeError("eval_dataset must be map-style (len and indexing): evaluation needs a fixed set")
    # Fixed by the spec (its local batch at its own world size), not by the world size this attempt
    # runs at: the same batches at any world.
    size = ev.batch_size or spec.local_batch_size()
    return Evaluator(
        plan=plan,
        dataset=plan.eval_dataset,
        env=env,
        device=device,
        batch_size=size,
        max_batches=ev.max_batches,
        autocast=autocast,
        loader_options=loader_options(spec.data, device, seed=spec.hyperparameters.seed, persistent=True),
    )


def metric_name(name: str) -> str:
    """`eval/<name>` for a name of `eval_metrics`; ValueError for names the API would not show."""
    full = f"eval/{name}"
    if name == "loss" or re.fullmatch(EVAL_METRIC_PATTERN[1:-1], full) is None:
        raise ValueError(
            f"eval_metrics name {name!r}: names are a letter then letters, digits, '_', '.' or '-' "
            "(at most 64), and 'loss' is the engine's own"
        )
    return full


def _sum_count(name: str, value: Any) -> tuple[Any, Any]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"eval_metrics[{name!r}] must be a (sum, count) pair, got {type(value).__name__}")
    return value[0], value[1]


def _f64(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64, device=device)
