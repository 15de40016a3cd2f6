"""LocalSGD (Paddle's LocalSGD, Caffe2's BMUF without block momentum): local steps, periodic averaging.

With `engine.mode: local_sgd` the first `local_sgd_warmup_steps` (W) optimizer steps are ordinary
allreduce steps. Every later step is local: each rank steps on its own gradient (DDP's `no_sync()` for
every micro-step), and the parameters are averaged over ranks right after the optimizer step that
brings ITER to W + m*k (m >= 1, k = `local_sgd_period`), i.e. after 0-based step `it` when
`it + 1 > W and (it + 1 - W) % k == 0`. Everything is a function of ITER, so a resumed job keeps the
schedule. At world size 1 there is nothing to do and the trainer builds no LocalSGD at all.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager


def averages_after(it: int, *, period: int, warmup_steps: int) -> bool:
    """Whether parameters are averaged right after 0-based step `it` (when ITER becomes it + 1)."""
    done = it + 1
    return done > warmup_steps and (done - warmup_steps) % period == 0


class LocalSGD:
    """Which steps skip the gradient allreduce, and torch's PeriodicModelAverager on an ITER-derived count."""

    def __init__(self, model: nn.Module, *, period: int, warmup_steps: int, skip: Iterable[str] = ()) -> None:
        self.period, self.warmup_steps = period, warmup_steps
        skipped = set(skip)
        # Non-data-parallel parameters are each rank's own (DDP ignores them too): never averaged.
        self.params = [p for n, p in model.named_parameters() if n not in skipped and p.requires_grad]
        with warnings.catch_warnings():
            # torch warns that period 1 is just DDP; we allow it (it is the tested equivalence with
            # allreduce mode), so the advice would only clutter every rank's log.
            warnings.filterwarnings("ignore", message="When period is 1", category=UserWarning)
            # torch's averager averages when `step >= warmup_steps and (step - warmup_steps) % period == 0`.
            # We set `step` to the ITER the step just reached; warmup_steps = W + k then gives exactly
            # ITER in {W + k, W + 2k, ...} and skips the redundant averaging at ITER == W (after an
            # allreduce step the replicas are already equal).
            self.averager = PeriodicModelAverager(period=period, warmup_steps=warmup_steps + period)

    def is_local(self, it: int) -> bool:
        """Whether 0-based step `it` runs without the gradient allreduce (it is past the warm-up)."""
        return it >= self.warmup_steps

    def after_step(self, it: int) -> None:
        """Average parameters if step `it` ends a period (see `averages_after`).

        Call after `optimizer.step()` and before `zero_grad(set_to_none=True)`: torch's averager only
        averages parameters whose `.grad` is not None.
        """
        # Derived from ITER, never counted here, so a resume from any checkpoint continues the schedule.
        self.averager.step = it + 1
        self.averager.average_parameters(self.params)
