"""A non-finite loss never reaches the weights, and the job fails naming the step and the rank.

Reading the loss on the host (`float(loss)`) every step would make the CPU wait for the GPU to
finish the step before it may queue the next one. Instead the check stays on the device:

- A step is bad when its local loss is not finite or, on CUDA at world > 1, when the averaged gradient
  is not (a NaN loss on one rank reaches every rank through the allreduce, so every rank skips the
  same step). On CPU only the loss is read: the rank whose loss is bad skips, the others' replicas may
  take the NaN-averaged step, and the check below fails the job before anything is saved or evaluated.
- Optimizers that can skip a step on the device (torch's fused ones, the same `found_inf` contract
  GradScaler uses) are handed the flag and skip it there, with no sync. Others are stepped only after
  the flag is read on the host: free on CPU, a sync per step on CUDA (the engine says so once in the
  rank's log; pass `fused=True` to Adam, AdamW or SGD to avoid it).
- Each rank keeps the first bad step on the device; `check()`, a collective at the points where every
  rank already agrees to stop (a metrics window, an evaluation, a save, the end), raises for the
  earliest bad step and names the ranks whose loss was not finite. A save always comes after a check,
  so no checkpoint holds a skipped step's aftermath.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from workers.engine import distributed


class NonFiniteGuard:
    """Decides, per step, whether the optimizer may step, and reports bad steps at `check()`."""

    def __init__(
        self, *, optimizer: torch.optim.Optimizer, env: distributed.DistEnv, device: torch.device
    ) -> None:
        self.optimizer, self.env, self.device = optimizer, env, device
        # torch's contract with GradScaler: such an optimizer reads `found_inf` and skips on the device.
        # Only worth it on CUDA: on CPU reading the flag costs nothing, the host path is simpler.
        self.on_device = device.type == "cuda" and bool(
            getattr(optimizer, "_step_supports_amp_scaling", False)
        )
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        # First bad step (1-based, 0 = none) where the local loss / the gradient was not finite.
        self.first_bad = torch.zeros(2, dtype=torch.int64, device=device)
        self.first_bad_host = [0, 0]  # the same, for steps decided on the host
        self._warned = False

    def _grads(self) -> list[torch.Tensor]:
        return [
            p.grad
            for g in self.optimizer.param_groups
            for p in g["params"]
            if p.grad is not None and not p.grad.is_sparse
        ]

    def _grad_norm(self) -> torch.Tensor | None:
        """On CUDA at world > 1, the averaged gradient's 2-norm (the same on every rank); else None."""
        # On CPU a pass over every gradient is a visible share of a small model's step, and a rank's
        # NaN loss is known on the host at once; the other ranks' replicas may then take the
        # NaN-averaged step, but the job fails at the next check, before anything is saved or evaluated.
        check = self.env.world_size > 1 and self.device.type == "cuda"
        grads = self._grads() if check else []
        if not grads:
            return None
        # Not finite if an entry is not (or if it overflows, which no sane step does). The inf-norm would
        # be exact but takes a slow per-element path on CPU, where the 2-norm has a fused kernel.
        return torch.stack(torch._foreach_norm(grads, 2.0)).sum()

    def step(self, it: int, loss: torch.Tensor) -> None:
        """`optimizer.step()` for step `it` (0-based) unless its loss or averaged gradient is not finite."""
        # Fused SGD fills a fresh momentum buffer with empty_like() and would keep it unfilled if its
        # first step were skipped on the device: with no optimizer state yet, decide on the host.
        if self.on_device and self.optimizer.state:
            loss_bad = ~torch.isfinite(loss.detach())
            norm = self._grad_norm()
            bad = loss_bad if norm is None else loss_bad | ~torch.isfinite(norm)
            step_no = torch.tensor(it + 1, dtype=torch.int64, device=self.device)
            marks = torch.stack([loss_bad, bad]).to(torch.int64) * step_no
            self.first_bad.copy_(torch.where(self.first_bad == 0, marks, self.first_bad))
            self.found_inf.copy_(bad)
            self.optimizer.found_inf = self.found_inf  # type: ignore[attr-defined]
            self.optimizer.step()
            return
        # On the host: free on CPU (no device queue to drain), one sync per step on CUDA.
        if self.device.type == "cuda" and not self.on_device and not self._warned:
            self._warned = True
            print(
                f"warning: {type(self.optimizer).__name__} cannot skip a step on the device: the engine "
                "reads every step's loss on the host (a sync per step); fused=True avoids it"
            )
        loss_bad_host = not math.isfinite(float(loss))
        norm = None if loss_bad_host else self._grad_norm()
        if not loss_bad_host and (norm is None or math.isfinite(float(norm))):
            self.optimizer.step()
            return
        for k, flag in enumerate((loss_bad_host, True)):
            if flag and not self.first_bad_host[k]:
                self.first_bad_host[k] = it + 1

    def check(self) -> None:
        """Collective: raise FloatingPointError if any rank had a bad step since the job (re)started."""
        # Steps only grow, so each kind's first bad step is the smaller non-zero of the two records.
        marks = zip(self.first_bad.tolist(), self.first_bad_host, strict=True)
        mine = [min((s for s in pair if s), default=0) for pair in marks]
        slots = torch.zeros((self.env.world_size, 2), dtype=torch.int64, device=self.device)
        slots[self.env.rank] = torch.tensor(mine, dtype=torch.int64, device=self.device)
        if distributed.active(self.env):
            dist.all_reduce(slots, op=dist.ReduceOp.SUM)
        rows = slots.tolist()
        steps = [s for row in rows for s in row if s]
        if not steps:
            return
        step = min(steps)
        culprits = [r for r, (loss_step, _) in enumerate(rows) if loss_step == step]
        if culprits:
            ranks = ("rank " if len(culprits) == 1 else "ranks ") + ", ".join(map(str, culprits))
            raise FloatingPointError(
                f"non-finite loss at step {step} on {ranks}: the update was skipped, the weights are finite"
            )
        raise FloatingPointError(
            f"non-finite gradient at step {step} (the loss was finite on every rank): the update was skipped"
        )
