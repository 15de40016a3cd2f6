"""Parameters sharded along dim 0 across ranks (model parallelism, e.g. Partial FC's classifier).

A sharded parameter holds rows `shard_range(total, world, rank)` of a full tensor on each rank. It is
never data-parallel (each rank's rows are its own), and checkpoints hold the full tensor: rank 0
gathers every rank's rows (and the matching optimizer state rows) when saving, and on load each rank
slices its rows back out, so a checkpoint written at world N resumes at world M.

Hand-written because torch's answers (FSDP2 / DTensor sharding, torch.distributed.checkpoint) shard
every parameter and write one file per rank; here only a few named parameters are sharded and the
checkpoint must stay one plain `torch.load(weights_only=True)` file with the full weight.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def shard_range(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of a `total`-row tensor held by `rank`; the first `total % world` get one more."""
    if world_size < 1 or not 0 <= rank < world_size or total < 0:
        raise ValueError(f"bad shard request: {total} rows, rank {rank} of {world_size}")
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_and_world() -> tuple[int, int]:
    """This process's (rank, world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather_rows(shard: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's rows concatenated, on rank 0 (other ranks get their own shard back)."""
    if world_size == 1:
        return shard
    # Shards differ by at most one row; gather needs equal sizes, so pad to the largest and cut after.
    rows = torch.tensor([shard.shape[0]], dtype=torch.int64, device=shard.device)
    counts = [torch.zeros_like(rows) for _ in range(world_size)]
    dist.all_gather(counts, rows)
    sizes = [int(c.item()) for c in counts]
    padded = shard.new_zeros((max(sizes), *shard.shape[1:]))
    padded[: shard.shape[0]] = shard
    is_dst = dist.get_rank() == 0
    parts = [torch.empty_like(padded) for _ in range(world_size)] if is_dst else None
    dist.gather(padded.contiguous(), parts, dst=0)
    if parts is None:
        return shard
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


def _slice_rows(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    start, stop = shard_range(full.shape[0], world_size, rank)
    return full[start:stop].clone()


def optimizer_param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter name of each index in `optimizer.state_dict()` (its params in param-group order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(_params(optimizer.param_groups))]


def _params(groups: Iterable[Mapping[str, Any]]) -> list[Any]:
    return [p for g in groups for p in g["params"]]


def _map_state(
    optim_state: dict[str, Any],
    names: Sequence[str],
    sharded: set[str],
    shard_rows: Mapping[str, int],
    fn: Any,
) -> dict[str, Any]:
    """A copy of an optimizer state_dict whose sharded params' row-shaped tensors went through `fn`."""
    state = dict(optim_state["state"])
    for idx, entry in state.items():
        name = names[int(idx)]
        if name not in sharded:
            continue
        rows = shard_rows[name]
        state[idx] = {
            k: fn(v) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else v
            for k, v in entry.items()
        }
    return {**optim_state, "state": state}


def gather_state(
    model_state: dict[str, Any],
    optim_state: dict[str, Any],
    *,
    sharded: Sequence[str],
    optim_names: Sequence[str],
    world_size: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state with every sharded tensor whole (on rank 0; a collective on all ranks)."""
    if not sharded:
        return model_state, optim_state
    rows = {n: int(model_state[n].shape[0]) for n in sharded}
    model_state = dict(model_state)
    for n in sharded:  # same order on every rank: the gathers line up
        model_state[n] = _gather_rows(model_state[n], world_size)
    # Row-shaped optimizer state (momentum buffers) is gathered in the optimizer's own, rank-invariant order.
    optim_state = _map_state(
        optim_state, optim_names, set(sharded), rows, lambda t: _gather_rows(t, world_size)
    )
    return model_state, optim_state


def slice_state(
    model_state: Mapping[str, Any],
    optim_state: dict[str, Any],
    *,
    sharded: Sequence[str],
    optim_names: Sequence[str],
    world_size: int,
    rank: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's rows of a full (checkpointed) state: the inverse of `gather_state` at any world size."""
    model_state = dict(model_state)
    if not sharded:
        return model_state, optim_state
    full_rows = {n: int(model_state[n].shape[0]) for n in sharded}
    for n in sharded:
        model_state[n] = _slice_rows(model_state[n], world_size, rank)
    optim_state = _map_state(
        optim_state, optim_names, set(sharded), full_rows, lambda t: _slice_rows(t, world_size, rank)
    )
    return model_state, optim_state
