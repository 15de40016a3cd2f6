"""Batched metrics: one loss allreduce and one event write per window of logged steps, not per step."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.engine import distributed
from workers.engine.events import EventWriter, MetricsEvent

# A window closes once it spans about TARGET_SECONDS of training: a user (and the job-start
# benchmark, which waits for the first step) sees metrics at most about this late, while at
# millisecond steps the allreduce and the write are paid once per many steps. MAX_WINDOW caps the
# steps held back (and the allreduced vector) when steps are very fast.
TARGET_SECONDS = 0.25
MAX_WINDOW = 64


def next_window(step_time: float) -> int:
    """Steps in the next window: about TARGET_SECONDS of steps of `step_time`, within 1..MAX_WINDOW."""
    if not step_time > 0:  # zero or NaN: as fast as can be measured
        return MAX_WINDOW
    # min() before floor(): a tiny step time would make the quotient overflow an int.
    return max(1, math.floor(min(float(MAX_WINDOW), TARGET_SECONDS / step_time)))


@dataclass(frozen=True)
class _Logged:
    """What a logged step's `metrics` event needs, held until its window is flushed."""

    step: int
    loss: torch.Tensor  # this rank's local mean loss (float32, on the device)
    lr: float
    grad_norm: torch.Tensor | None
    seconds: float  # since the previous logged step (or the end of a save), on this rank's clock
    data_wait: float  # of those seconds, the time this rank waited for its batches
    steps: int  # steps in those seconds
    time: float  # wall clock when the step ended: the event's `time`


class MetricsWindow:
    """Holds logged steps and reports them per window: one allreduce, one write (rank 0 writes).

    Every decision to flush depends only on step numbers, the checkpoint schedule and a step time
    that the flush's own allreduce gives every rank, so all ranks issue the flush's collective after
    the same step, in the same place among the job's other collectives.
    """

    def __init__(
        self,
        *,
        env: distributed.DistEnv,
        device: torch.device,
        events: EventWriter,
        global_batch_size: int,
        log_every: int,
        total_steps: int,
        start_step: int,
    ) -> None:
        self.env, self.device, self.events = env, device, events
        self.global_batch_size, self.log_every, self.total_steps = global_batch_size, log_every, total_steps
        # The first window is one step, so the first logged step is reported as soon as it ends.
        self.window = 1
        self.window_start = start_step
        self.pending: list[_Logged] = []
        self._mark, self._mark_step = time.perf_counter(), start_step

    def logs(self, step: int) -> bool:
        """Whether `step` gets a `metrics` event (every `log_every` steps and the last)."""
        return step % self.log_every == 0 or step == self.total_steps

    def restart_clock(self, step: int) -> None:
        """Start step timing afresh after `step` (a checkpoint save's time is not step time)."""
        self._mark, self._mark_step = time.perf_counter(), step

    def record(
        self,
        step: int,
        *,
        loss: torch.Tensor,
        lr: float,
        grad_norm: torch.Tensor | None,
        data_wait: float = 0.0,
    ) -> None:
        """Hold a logged step's local loss, lr, grad norm and timing until its window is flushed.

        `data_wait`: seconds this rank waited for data since the previous logged step.
        """
        now = time.perf_counter()
        self.pending.append(
            _Logged(
                step=step,
                loss=loss.detach().float(),
                lr=lr,
                grad_norm=None if grad_norm is None else grad_norm.detach(),
                seconds=now - self._mark,
                data_wait=data_wait,
                steps=step - self._mark_step,
                time=time.time(),
            )
        )
        self._mark, self._mark_step = now, step

    def due(self, step: int, *, force: bool) -> bool:
        """Whether to flush after `step`; `force` at the last step and before a save (same on every rank)."""
        return bool(self.pending) and (force or step - self.window_start >= self.window)

    def maybe_flush(self, step: int, *, force: bool = False) -> None:
        """Flush after `step` if `due`."""
        if self.due(step, force=force):
            self.flush(step)

    def flush(self, step: int) -> None:
        """Reduce the held losses in one allreduce, write their events (rank 0), pick the next window."""
        held, self.pending = self.pending, []
        # Rank 0's step time rides along (the others add 0.0, so the sum is exactly rank 0's figure):
        # the next window's length is then computed from the same float on every rank.
        step_time = sum(p.seconds for p in held) / sum(p.steps for p in held) if self.env.is_main else 0.0
        clock = torch.tensor(step_time, dtype=torch.float32, device=self.device)
        n = len(held)
        # Each rank's data wait rides along too, so the figure reported is the mean over ranks.
        waits = torch.tensor([p.data_wait for p in held], dtype=torch.float32, device=self.device)
        vec = torch.cat([torch.stack([p.loss for p in held]), waits, clock.reshape(1)])
        losses, waited = vec[:n], vec[n : 2 * n]
        if distributed.active(self.env):
            # Sum then divide, in float32, as a per-step allreduce of each loss would. At world 2 each
            # element is bitwise that result (a + b is commutative); past 2 ranks a ring allreduce may
            # add an element's terms in another order than for a lone scalar (last-bit differences).
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
            losses, waited = vec[:n] / self.env.world_size, vec[n : 2 * n] / self.env.world_size
        if self.env.is_main:
            self._emit(held, losses.tolist(), waited.tolist())
        self.window = next_window(float(vec[-1]))
        self.window_start = step

    def _emit(self, held: Sequence[_Logged], losses: list[float], waited: list[float]) -> None:
        norms = [p.grad_norm for p in held if p.grad_norm is not None]
        # One conversion for all norms (one device sync on CUDA, not one per step).
        norm_values = iter(torch.stack(norms).tolist() if norms else [])
        rows = []
        for p, loss, wait in zip(held, losses, waited, strict=True):
            values = {
                "loss": loss,
                "lr": p.lr,
                "samples_per_s": self.global_batch_size * p.steps / p.seconds,
                "step_time_s": p.seconds / p.steps,
                # Of each step's time, how long the ranks (on average) waited for their batches.
                "data_wait_s": wait / p.steps,
            }
            if p.grad_norm is not None:
                # From averaged grads, so identical on every rank: no collective (in a LocalSGD local
                # step it is rank 0's own).
                values["grad_norm"] = next(norm_values)
            rows.append(MetricsEvent(time=p.time, step=p.step, values=values))
        self.events.emit_many(rows)
