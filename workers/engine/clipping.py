"""Gradient clipping by the total norm of the whole model, whatever its gradients look like.

torch's `clip_grad_norm_` refuses sparse gradients and knows nothing of rows held by other ranks, so
it is used as is only when neither occurs; otherwise the same formula is applied here by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn


def _norm(g: torch.Tensor) -> torch.Tensor:
    # An uncoalesced sparse gradient may list a row twice: the norm is that of the summed rows.
    return torch.linalg.vector_norm((g.coalesce().values() if g.is_sparse else g).detach().float())


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter], max_norm: float, *, sharded: Sequence[nn.Parameter] = ()
) -> torch.Tensor:
    """Clip like torch's clip_grad_norm_; sparse grads allowed, `sharded` params' norms summed over ranks."""
    params = [p for p in parameters if p.grad is not None]
    shards = [p for p in sharded if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]
    shard_grads = [p.grad for p in shards if p.grad is not None]
    if not shards and not any(g.is_sparse for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    device = (params or shards)[0].device if params or shards else torch.device("cpu")
    zero = torch.zeros((), dtype=torch.float32, device=device)
    local_sq = torch.linalg.vector_norm(torch.stack([_norm(g) for g in grads])) ** 2 if grads else zero
    shard_sq = (
        torch.linalg.vector_norm(torch.stack([_norm(g) for g in shard_grads])) ** 2 if shard_grads else zero
    )
    if sharded and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Replicated gradients are already equal on every rank; each rank's shard rows are its own, so
        # only their part of the norm is summed across ranks (a collective every rank makes).
        dist.all_reduce(shard_sq, op=dist.ReduceOp.SUM)
    total = torch.sqrt(local_sq + shard_sq)
    # torch's formula, so a model without sparse or sharded grads clips exactly as before.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in [*params, *shards]:
        g = p.grad
        assert g is not None
        if g.is_sparse:
            p.grad = g * coef
        else:
            g.mul_(coef.to(g.dtype))
    return total
