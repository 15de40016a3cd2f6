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
