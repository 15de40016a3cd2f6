"""A complete dptrain entrypoint: your own model, data, loss, optimizer and learning-rate schedule.

Submit it with `entrypoint: "examples.custom_plan:build"` on a server whose workers have
`DPTRAIN_ALLOWED_ENTRYPOINTS=examples` (and this package importable). dptrain calls
`build(hyperparameters, seed)` once on every rank, after seeding torch's RNG with `seed`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dptrain import Plan


def _dataset(features: int, size: int, seed: int) -> TensorDataset:
    # Data must be a function of the seed alone, so every rank (and every world size) sees the same.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(size, 1, generator=g)
    return TensorDataset(x, y)


def build(hp: Mapping[str, Any], seed: int) -> Plan:
    """A small regression net trained with AdamW and a step-decay schedule."""
    features = int(hp.get("features", 16))
    model = nn.Sequential(nn.Linear(features, 32), nn.Tanh(), nn.Linear(32, 1))

    def optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=float(hp["lr"]), weight_decay=float(hp["weight_decay"]))

    def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=int(hp.get("decay_every", 3)), gamma=0.5)

    return Plan(
        model=model,
        dataset=_dataset(features, int(hp.get("dataset_size", 512)), seed),  # map-style: (x, y) items
        loss_fn=nn.functional.mse_loss,  # the mean over the batch it is given
        optimizer=optimizer,
        lr_scheduler=schedule,
    )
