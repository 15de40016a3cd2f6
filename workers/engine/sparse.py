"""Sparse gradients (Caffe2's GradientSlice sync): embedding tables kept out of DDP and averaged here.

`nn.Embedding` / `nn.EmbeddingBag` with `sparse=True` produce a sparse COO gradient holding only the
rows the batch touched. At world > 1 the trainer leaves those parameters out of DDP and, after the
last micro-step's backward, replaces each rank's sparse gradient by the average over ranks:

* `allgather`: every rank coalesces its gradient, the ranks all-gather their row counts, then their
  (padded) row indices and values; each rank concatenates them, sums duplicate rows (coalesce) and
  divides by the world size. Only touched rows travel, and `all_gather` works on Gloo and NCCL.
* `dense`: densify, all-reduce SUM, divide, and hand the optimizer a sparse gradient again.

Both give every rank the same gradient as the global-batch mean loss at world 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

SPARSE_MODULES = (nn.Embedding, nn.EmbeddingBag)


def sparse_param_names(model: nn.Module, skip: Iterable[str] = ()) -> list[str]:
    """Names of the parameters with sparse gradients: weights of Embedding/EmbeddingBag(sparse=True)."""
    skipped = set(skip)
    names = []
    for module_name, module in model.named_modules():
        if isinstance(module, SPARSE_MODULES) and module.sparse:
            name = f"{module_name}.weight" if module_name else "weight"
            if name not in skipped:
                names.append(name)
    return names


def ddp_ignore_names(names: Iterable[str]) -> list[str]:
    """`names` in both spellings DDP matches: "scale" and ".scale" for the root module's own tensors."""
    # DDP (torch 2.13) checks its initial broadcast against named_parameters() names ("scale") but
    # builds its allreduce buckets from f"{module_name}.{param_name}", which for a parameter of the
    # root module is ".scale": listing "scale" alone kept it out of the broadcast yet still averaged
    # its gradient (tests/engine/test_sparse_embedding.py caught it). Nested names agree in both.
    out: list[str] = []
    for name in names:
        out += [name, f".{name}"] if "." not in name else [name]
    return out


def refuse_clipping_of_local_params(
    model: nn.Module, non_data_parallel: Sequence[str], clip: float | None
) -> None:
    """Refuse `engine.grad_clip_norm` when a non-data-parallel parameter takes a gradient."""
    if clip is None:
        return
    local = [n for n, p in model.named_parameters() if n in set(non_data_parallel) and p.requires_grad]
    if local:
        # One norm over all gradients, these rank-own ones included, differs per rank: each rank would
        # scale its (identical) averaged gradients by a different factor and the replicas drift apart.
        raise ValueError(
            "engine.grad_clip_norm cannot be combined with non-data-parallel parameters "
            f"({', '.join(local)}) at world size > 1: ranks would clip by different factors"
        )


def fusable(params: Sequence[torch.Tensor]) -> bool:
    """Whether torch's fused SGD takes `params`: dense floating-point tensors on a device it supports."""
    devices = set(_get_fused_kernels_supported_devices())
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


def default_sgd(model: nn.Module, lr: float, momentum: float, weight_decay: float) -> torch.optim.SGD:
    """The engine's default SGD; parameters with sparse gradients get their own group (plain SGD)."""
    sparse = set(sparse_param_names(model))
    if not sparse:
        params = list(model.parameters())
        # torch's fused SGD: one kernel per step for every tensor instead of three ops per tensor (the
        # CPU default is the per-tensor loop). The same update rule, rounded in another order, so the
        # weights agree with the loop's to the last bits, not bitwise (docs/engine.md, "Fused SGD").
        # The setting is stored in the optimizer's state, so a resumed run keeps the implementation
        # it was saved with.
        return torch.optim.SGD(
            params, lr=lr, momentum=momentum, weight_decay=weight_decay, fused=fusable(params) or None
        )
    named = list(model.named_parameters())
    # torch's SGD cannot do the spec's momentum and weight decay on a sparse gradient: weight decay
    # fails (add(sparse, dense) is not supported), and the momentum buffer is kept as an uncoalesced
    # sparse tensor that grows by the gradient's rows every step (a 100-row table: 1040 entries after
    # 50 steps). Exact decay or momentum would also move every row every step, which is the dense
    # update sparse gradients exist to avoid. So sparse tables get plain SGD at the spec's lr: only
    # touched rows move (Caffe2's ScatterWeightedSum update of a GradientSlice); dense params keep all.
    groups: list[dict[str, Any]] = [
        {"params": [p for n, p in named if n not in sparse]},
        {"params": [p for n, p in named if n in sparse], "momentum": 0.0, "weight_decay": 0.0},
    ]
    return torch.optim.SGD(
        [g for g in groups if g["params"]], lr=lr, momentum=momentum, weight_decay=weight_decay
    )


def _check_rows(grad: torch.Tensor) -> None:
    if grad.sparse_dim() != 1:
        raise ValueError(f"expected a row-sparse gradient (sparse_dim 1), got sparse_dim {grad.sparse_dim()}")


def allgather_average(grad: torch.Tensor | None, like: torch.Tensor, world: int) -> torch.Tensor | None:
    """The rank-average of a row-sparse gradient from all ranks' (indices, values); None if none has one."""
    device = like.device
    if grad is not None:
        _check_rows(grad)
        g = grad.coalesce()
        indices, values = g.indices(), g.values()
        count = indices.shape[1]
    else:
        # A rank whose batch never reached the table still takes part in every collective.
        indices = torch.empty(1, 0, dtype=torch.long, device=device)
        values = torch.empty(0, *like.shape[1:], dtype=like.dtype, device=device)
        count = -1  # "no gradient", told apart from "a gradient with no rows"
    mine = torch.tensor([count], dtype=torch.long, device=device)
    counts_t = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(counts_t, mine)
    counts = [int(c.item()) for c in counts_t]
    if max(counts) < 0:
        return None  # like world 1: no gradient, so the optimizer skips the parameter
    width = max(counts)
    if width == 0:
        return torch.sparse_coo_tensor(indices, values, like.shape, is_coalesced=True)
    # all_gather needs equal shapes: pad every rank's rows to the largest count.
    n = indices.shape[1]
    padded_i = torch.zeros(1, width, dtype=torch.long, device=device)
    padded_i[:, :n] = indices
    padded_v = torch.zeros(width, *like.shape[1:], dtype=values.dtype, device=device)
    padded_v[:n] = values
    all_i = [torch.empty_like(padded_i) for _ in range(world)]
    all_v = [torch.empty_like(padded_v) for _ in range(world)]
    dist.all_gather(all_i, padded_i)
    dist.all_gather(all_v, padded_v)
    kept = [(i[:, :c], v[:c]) for i, v, c in zip(all_i, all_v, counts, strict=True) if c > 0]
    total = torch.sparse_coo_tensor(
        torch.cat([i for i, _ in kept], dim=1), torch.cat([v for _, v in kept]), like.shape
    ).coalesce()  # sums the rows several ranks touched
    return torch.sparse_coo_tensor(total.indices(), total.values() / world, like.shape, is_coalesced=True)


def dense_average(grad: torch.Tensor | None, like: torch.Tensor, world: int) -> torch.Tensor | None:
    """The rank-average of a row-sparse gradient by a dense all-reduce; returned sparse again."""
    # One collective: the densified gradient plus a trailing "this rank has a gradient" flag.
    flat = torch.zeros(like.numel() + 1, dtype=like.dtype, device=like.device)
    if grad is not None:
        _check_rows(grad)
        flat[:-1] = grad.to_dense().reshape(-1)
        flat[-1] = 1
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    if flat[-1].item() == 0:
        return None
    # Back to the layout the optimizer saw at world 1 (SparseAdam refuses dense gradients); rows whose
    # summed gradient is exactly zero drop out, which changes no SGD/Adagrad update.
    return (flat[:-1].view_as(like) / world).to_sparse(sparse_dim=1)


class SparseGradSync:
    """Averages the sparse gradients of the parameters DDP was told to ignore."""

    def __init__(self, params: dict[str, nn.Parameter], mode: str, world_size: int) -> None:
        if mode not in ("allgather", "dense"):
            raise ValueError(f"engine.sparse must be 'allgather' or 'dense', got {mode!r}")
        self.params, self.mode, self.world_size = params, mode, world_size

    @classmethod
    def for_model(
        cls, model: nn.Module, mode: str, world_size: int, skip: Sequence[str] = ()
    ) -> SparseGradSync:
        """Sync for every sparse-gradient parameter of `model` except the non-data-parallel `skip`."""
        named = dict(model.named_parameters())
        return cls({n: named[n] for n in sparse_param_names(model, skip)}, mode, world_size)

    @property
    def names(self) -> list[str]:
        """The synchronised parameters' names (for DDP's ignore list)."""
        return list(self.params)

    def broadcast_from_rank0(self) -> None:
        """Give every rank rank 0's tables: DDP broadcasts only the parameters it manages."""
        for p in self.params.values():
            dist.broadcast(p.detach(), src=0)

    def sync(self) -> None:
        """Replace every rank's sparse gradients by their average over ranks (same order on all ranks)."""
        average = allgather_average if self.mode == "allgather" else dense_average
        for p in self.params.values():
            p.grad = average(p.grad, p, self.world_size)
