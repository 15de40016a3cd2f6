"""Evaluation on the plan's eval dataset: exact sums and counts over an eval set split across ranks.

The eval set is cut, in order, into batches whose size does not depend on the world size, and only
the first `max_batches` are used, so the samples evaluated are the same at 1, 2 or 3 ranks. Two cuts:

- split (the default, `evaluation.batch_size` null): global batches of the training's global batch
  size, each split over the ranks at run time, rank r evaluating its contiguous part (as torch's
  `tensor_split` cuts: the first `n % W` ranks one sample more), so a rank holds about a local batch,
  as in training. A batch's per-sample figures are the same however it is split; only the rounding of
  each part's mean loss differs between world sizes (float32 when the plan computes in float32).
- fixed (`evaluation.batch_size` set): batches of that size, batch i evaluated whole by rank i % W.
  Each batch is computed exactly as at any other world size (same samples, same weights).

Every rank adds `loss * samples` and each metric's (sum, count) in float64, and one allreduce adds the
ranks' totals. So the figures are the same at 1, 2 or 3 ranks, however unevenly the batches fall: in
fixed mode up to the order of that last float64 sum, in split mode up to the rounding of per-part means.

Plans with sharded parameters run collectives inside their forward and loss (a model-parallel
classifier): there every rank takes part in every round, a rank without samples in a round (a split
batch smaller than the world, or no fixed batch left) evaluating an empty one that adds nothing.
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
        split: bool = False,
        loader_options: dict[str, Any] | None = None,
    ) -> None:
        self.plan, self.env, self.device, self.autocast = plan, env, device, autocast
        # `batch(indices, device)` form, for the empty batches of lockstep rounds.
        self.dataset = batch_source(dataset, plan.collate_fn)
        self.batch_size, self.split = batch_size, split
        size = len(dataset)
        if size < 1:
            raise ValueError("the plan's eval_dataset is empty")
        batches = math.ceil(size / batch_size)
        self.batches = min(batches, max_batches) if max_batches is not None else batches
        self.size = size
        # Collectives inside the model: every rank steps through every round (see the module docstring).
        self.lockstep = bool(plan.sharded)
        # One loader for every evaluation, so persistent loader processes (data.persistent_workers)
        # stay between them; None where this rank has no samples at all.
        mine = [torch.arange(a, b, dtype=torch.long) for a, b in self.my_parts() if b > a]
        self.loader = (
            map_loader(dataset, plan.collate_fn, fixed_batch_sampler(mine), loader_options or {})
            if mine
            else None
        )

    def _batch(self, i: int) -> tuple[int, int]:
        start = i * self.batch_size
        return start, min(start + self.batch_size, self.size)

    def my_parts(self) -> list[tuple[int, int]]:
        """The [start, stop) sample ranges this rank evaluates, in order; in lockstep mode one per round.

        Split: its part of every batch, empty where a batch has fewer samples than ranks (left out
        unless lockstep). Fixed: batches rank, rank + W, ... whole, padded in lockstep mode with empty
        ones to the number of rounds.
        """
        rank, world = self.env.rank, self.env.world_size
        if self.split:
            parts = [_part(*self._batch(i), rank, world) for i in range(self.batches)]
            return parts if self.lockstep else [(a, b) for a, b in parts if b > a]
        parts = [self._batch(i) for i in range(rank, self.batches, world)]
        if self.lockstep:
            parts += [(0, 0)] * (math.ceil(self.batches / world) - len(parts))
        return parts

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
        for start, stop in self.my_parts():
            n = stop - start
            if n > 0:
                assert loaded is not None
                batch = loaded.take()
            else:
                batch = self.dataset.batch(torch.empty(0, dtype=torch.long), self.device)
            with self.autocast():
                loss, outputs = loss_and_outputs(self.plan, model, batch)
                figures = self.plan.eval_metrics(outputs, batch) if self.plan.eval_metrics else {}
            if n == 0:
                continue  # an empty lockstep batch: it ran for the collectives, it adds nothing
            if batch_size(batch) != n:
                raise ValueError(f"the eval dataset gave {batch_size(batch)} samples for {n} indices")
            totals[LOSS] += torch.stack([check_loss(loss).detach().double() * n, _f64(n, self.device)])
            for name, value in figures.items():
                key = metric_name(name)
                pair = torch.stack([_f64(v, self.device) for v in _sum_count(name, value)])
                totals[key] = totals[key] + pair if key in totals else pair

    def _batches(self) -> Batches | None:
        if self.loader is None:
            return None
        # Error messages name the eval batch: split, this rank has a part of each (the ones it lacks
        # are at the end); fixed, every W-th.
        first, every = (0, 1) if self.split else (self.env.rank, self.env.world_size)
        return Batches(
            self.loader, device=self.device, rank=self.env.rank, first=first, every=every, label="eval batch"
        )

    def close(self) -> None:
        """End persistent loader processes (the last evaluation is over)."""
        shutdown_workers(getattr(self.loader, "_iterator", None))  # kept only for persistent workers

    def _reduce(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        names = sorted(totals)
        if distributed.active(self.env):
            # Rank 0 always has samples of batch 0 (its part is never the empty one), so it knows every
            # metric name the plan reports; a rank without samples knows none. Its list orders the one
            # allreduce; a rank that saw a name rank 0 did not counts itself in slot 0, so every rank
            # raises together instead of hanging in a collective.
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
    # Neither cut depends on the world size this attempt runs at: the same samples at any world.
    # By default a global batch, split over the ranks (each holds a local batch, as in training).
    return Evaluator(
        plan=plan,
        dataset=plan.eval_dataset,
        env=env,
        device=device,
        batch_size=ev.batch_size or spec.hyperparameters.global_batch_size,
        max_batches=ev.max_batches,
        autocast=autocast,
        split=ev.batch_size is None,
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


def _part(start: int, stop: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous share of [start, stop) split over `world` ranks, as `tensor_split` cuts."""
    size, extra = divmod(stop - start, world)
    first = start + rank * size + min(rank, extra)
    return first, first + size + (rank < extra)


def _f64(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64, device=device)
