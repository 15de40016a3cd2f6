"""CUDA checks: every recipe at world size 1 on `device: cuda`, fp32 and bf16, over NCCL.

CI has no GPU, so these skip there; run them on a GPU host with `pytest tests/gpu`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from api_schemas import RECIPES

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.e2e,  # torchrun
]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_trains_on_cuda(
    recipe: str, precision: str, make_spec: Callable[..., dict[str, Any]], engine_runner: Callable[..., Any]
) -> None:
    spec = make_spec(engine={"precision": precision}, resources={"device": "cuda"})
    spec["recipe"] = recipe
    spec["hyperparameters"] = {k: v for k, v in spec["hyperparameters"].items() if k != "hidden_size"}
    run = engine_runner(spec, 1)
    assert run.returncode == 0, run.describe()
    started = next(e for e in run.events(0) if e["type"] == "started")
    assert started["device"] == "cuda", started
    losses = [e["values"]["loss"] for e in run.events(0) if e["type"] == "metrics"]
    assert losses and all(math.isfinite(x) for x in losses), losses
    assert run.checkpoint(spec["hyperparameters"]["steps"])["iter"] == spec["hyperparameters"]["steps"]


def test_pinned_batches_reach_the_gpu_from_loader_processes(
    make_spec: Callable[..., dict[str, Any]], engine_runner: Callable[..., Any]
) -> None:
    """`data.pin_memory` is on by default for cuda jobs: loader processes, pinned host batches, a
    non-blocking copy; the parameters equal those of loading in the rank (same batches, same order)."""
    spec = make_spec(resources={"device": "cuda"}, data={"num_workers": 2})
    piped = engine_runner(spec, 1)
    plain = engine_runner({**spec, "data": {"num_workers": 0, "pin_memory": False}}, 1)
    steps = spec["hyperparameters"]["steps"]
    for run in (piped, plain):
        assert run.returncode == 0, run.describe()
    a, b = piped.checkpoint(steps)["model"], plain.checkpoint(steps)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a), "pinned loading changed the parameters"
    waits = [e["values"]["data_wait_s"] for e in piped.events(0) if e["type"] == "metrics"]
    assert waits and all(w >= 0 for w in waits), waits


def test_the_loader_pins_host_batches_and_copies_them_without_blocking() -> None:
    from api_schemas.data import DataSpec
    from workers.engine.batch_loader import Batches, loader_options, map_loader, step_batch_sampler
    from workers.engine.batch_sampler import GlobalBatchSampler, TensorDataset

    data = TensorDataset(inputs=torch.randn(64, 8), targets=torch.arange(64))
    device = torch.device("cuda", 0)
    options = loader_options(DataSpec(), device, seed=0)
    assert options["pin_memory"] is True
    indices = step_batch_sampler(GlobalBatchSampler(64, 16, 0), rank=0, local_batch_size=16, first=0, stop=3)
    loader = map_loader(data, None, indices, options)
    assert all(t.is_pinned() for batch in loader for t in batch), "expected pinned host batches"
    batches = Batches(loader, device=device, rank=0, first=0)
    x, y = batches.take()
    batches.prefetch()
    assert x.is_cuda and y.is_cuda and torch.equal(y.cpu(), GlobalBatchSampler(64, 16, 0).global_indices(0))
