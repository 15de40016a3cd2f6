"""Differentiable collectives for user model code (usable inside forward; Gloo and NCCL).

Every function returns a new tensor (inputs are never mutated) and has a correct backward, where
"correct" means: each rank's output feeds that rank's own loss and the job's objective is the sum of
the per-rank losses, so d(total)/dx_r sums the contributions of every rank's grad_out.

Without an initialised process group every function is the identity (a single rank, world size 1).

Reused from torch (``torch.distributed.nn.functional``, whose backward is right for these):
  * all_reduce with SUM: backward = all_reduce(SUM) of grad_out.
  * broadcast: backward = reduce(SUM) of grad_out to src, zeros elsewhere.
  * all_gather: backward = reduce-scatter(SUM) of the per-rank grads (each rank its own slice).
Written here, because torch's ``_AllReduce.backward`` all-reduces grad_out with the *forward* op,
which is only right for SUM (for MAX it would give every rank max(grad_out)):
  * all_reduce with MAX/MIN (``_AllReduceExtreme``) and PROD (``_AllReduceProd``).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch.autograd.function import FunctionCtx, once_differentiable

ReduceName = Literal["sum", "max", "min", "prod"]
_EXTREME_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_SHAPE_FAST_DIMS = 8  # dims checked in the first (usually only) shape-agreement round of all_gather

__all__ = ["all_gather", "all_reduce", "broadcast"]


def _group_size(group: Any) -> int | None:
    """World size of `group`, or None when no process group exists (the single-rank case)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was passed but torch.distributed is not initialised")
        return None
    return dist.get_world_size(group=group)


def _torch_collective(fn: Any, *args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Call a torch.distributed.nn.functional collective without its deprecation FutureWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return fn(*args, **kwargs)  # type: ignore[no-any-return]


def _group_arg(group: Any) -> Any:
    """torch.distributed.nn.functional wants an explicit group (its default is group.WORLD)."""
    return dist.group.WORLD if group is None else group


class _AllReduceExtreme(torch.autograd.Function):
    """MAX/MIN all-reduce whose gradient goes to the rank(s) holding the extreme value.

    Tie rule: every element equal to the result on some rank is a winner; the summed grad_out is
    split evenly among the winners (divided by the all-reduced count of ties), matching torch.amax.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, op_name: str, group: Any) -> torch.Tensor:
        out = x.detach().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=_EXTREME_OPS[op_name], group=group)
        ctx.save_for_backward(x, out)
        ctx.group = group  # type: ignore[attr-defined]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, out = ctx.saved_tensors
        mask = (x == out).to(grad_out.dtype)
        # One collective for both sums: [sum of grad_out over ranks, number of tied winners].
        both = torch.stack([grad_out.expand_as(out), mask]).contiguous()
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=ctx.group)
        grad_sum, ties = both[0], both[1]
        return mask * grad_sum / ties.clamp_min(1), None, None


class _AllReduceProd(torch.autograd.Function):
    """PROD all-reduce; backward uses the product of the *other* ranks' values, so zeros are exact."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.detach().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.PRODUCT, group=group)
        ctx.save_for_backward(x)
        ctx.group = group  # type: ignore[attr-defined]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        group = ctx.group
        # d(prod_q x_q)/dx_r = prod_{q != r} x_q: gather every rank's x rather than dividing the
        # result by x_r, which would be 0/0 wherever x_r == 0.
        xs = [
            torch.empty_like(x, memory_format=torch.contiguous_format)
            for _ in range(dist.get_world_size(group))
        ]
        dist.all_gather(xs, x.detach().contiguous(), group=group)
        rank = dist.get_rank(group=group)
        others = xs[:rank] + xs[rank + 1 :]
        prod_others = torch.stack(others).prod(dim=0) if others else torch.ones_like(x)
        grad_sum = grad_out.contiguous().clone()
        dist.all_reduce(grad_sum, op=dist.ReduceOp.SUM, group=group)
        return grad_sum * prod_others, None


def all_reduce(x: torch.Tensor, op: ReduceName = "sum", *, group: Any = None) -> torch.Tensor:
    """Differentiable all-reduce (sum/max/min/prod) across ranks; returns a new tensor."""
    if op not in ("sum", "max", "min", "prod"):
        raise ValueError(f"unknown reduce op {op!r}; expected 'sum', 'max', 'min' or 'prod'")
    if _group_size(group) is None:
        return x.clone()
    if op == "sum":
        # torch's backward (all_reduce SUM of grad_out) is exactly right for SUM.
        out = _torch_collective(dist_fn.all_reduce, x, op=dist.ReduceOp.SUM, group=_group_arg(group))
        assert isinstance(out, torch.Tensor)
        return out
    if op == "prod":
        return _AllReduceProd.apply(x, group)  # type: ignore[no-any-return]
    return _AllReduceExtreme.apply(x, op, group)  # type: ignore[no-any-return]


def broadcast(x: torch.Tensor, src: int = 0, *, group: Any = None) -> torch.Tensor:
    """Differentiable broadcast of rank `src`'s tensor; backward sums grads onto `src`, zeros elsewhere."""
    size = _group_size(group)
    if size is None:
        if src != 0:
            raise ValueError(f"broadcast src={src} but there is no process group (only rank 0 exists)")
        return x.clone()
    if not 0 <= src < size:
        raise ValueError(f"broadcast src={src} is outside the group of size {size}")
    out = _torch_collective(dist_fn.broadcast, x, src, group=_group_arg(group))
    assert isinstance(out, torch.Tensor)
    return out


def _check_same_shape(x: torch.Tensor, group: Any) -> None:
    """Raise ValueError on every rank (together, so none hangs) unless all ranks' x have one shape."""

    def spread(values: list[int]) -> list[int]:
        # MAX-reduce [v, -v] pairs: a value agrees across ranks iff max(v) == -max(-v).
        t = torch.tensor([s for v in values for s in (v, -v)], dtype=torch.int64, device=x.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return [int(a) + int(b) for a, b in zip(t[0::2].tolist(), t[1::2].tolist(), strict=True)]

    shape = list(x.shape)
    head = shape[:_SHAPE_FAST_DIMS] + [0] * (_SHAPE_FAST_DIMS - min(len(shape), _SHAPE_FAST_DIMS))
    gaps = spread([x.dim(), *head])
    if gaps[0] == 0 and x.dim() > _SHAPE_FAST_DIMS:  # rare: ndim agrees and exceeds the fast path
        gaps += spread(shape[_SHAPE_FAST_DIMS:])
    if any(gaps):
        raise ValueError(
            f"all_gather needs the same shape on every rank; this rank has {tuple(x.shape)} "
            "and at least one other rank differs"
        )


def all_gather(x: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """Differentiable all-gather: every rank's x concatenated along dim 0 (shapes must be equal)."""
    if _group_size(group) is not None:
        _check_same_shape(x, group)  # first, so that every rank raises together on any mismatch
    if x.dim() == 0:
        raise ValueError("all_gather needs at least one dimension to concatenate along (got a 0-d tensor)")
    if _group_size(group) is None:
        return x.clone()
    # torch's backward reduce-scatters the grads: rank r gets its slice of sum-over-ranks(grad_out).
    parts = _torch_collective(dist_fn.all_gather, x, group=_group_arg(group))
    assert isinstance(parts, tuple)
    return torch.cat(parts, dim=0)
