"""Data parallelism's key property: 1, 2 and 4 ranks at the same global batch train to the same parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from api_schemas import JobSpec
from workers.engine.recipes import builder_of, plan_params

pytestmark = pytest.mark.e2e  # both tests read the equivalence runs (torchrun)

TOLERANCE = 1e-6


def _initial_params(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    job = JobSpec.model_validate(spec)
    torch.manual_seed(job.hyperparameters.seed)
    return builder_of(job)(plan_params(job), job.hyperparameters.seed).model.state_dict()


def test_same_result_at_any_world_size(
    equivalence_runs: dict[int, Any], equivalence_spec: dict[str, Any]
) -> None:
    steps = equivalence_spec["hyperparameters"]["steps"]
    finals = {w: run.checkpoint(steps) for w, run in equivalence_runs.items()}
    ref = finals[1]["model"]
    init = _initial_params(equivalence_spec)
    assert set(ref) == set(init), f"expected keys {sorted(init)} (no 'module.' prefix), got {sorted(ref)}"
    moved = max((ref[k] - init[k]).abs().max().item() for k in ref)
    assert moved > 1e-4, f"expected training to move the parameters, max change was {moved:.3g}"
    for w, state in finals.items():
        assert state["iter"] == steps, f"world {w}: expected iter {steps}, got {state['iter']}"
        assert state["world_size"] == w, (
            f"world {w}: expected world_size {w} in checkpoint, got {state['world_size']}"
        )
        for name, tensor in state["model"].items():
            diff = (tensor - ref[name]).abs().max().item()
            assert diff <= TOLERANCE, (
                f"world {w} vs world 1: expected |{name} diff| <= {TOLERANCE}, got {diff:.3g}"
            )


def test_global_loss_matches_across_world_sizes(equivalence_runs: dict[int, Any]) -> None:
    def losses(run: Any) -> dict[int, float]:
        return {e["step"]: e["values"]["loss"] for e in run.events(0) if e["type"] == "metrics"}

    ref = losses(equivalence_runs[1])
    assert ref, "expected metrics events from the world-1 run, got none"
    for w, run in equivalence_runs.items():
        got = losses(run)
        assert got.keys() == ref.keys(), (
            f"world {w}: expected metrics at steps {sorted(ref)}, got {sorted(got)}"
        )
        for step, loss in ref.items():
            assert abs(got[step] - loss) <= 1e-5, (
                f"world {w} step {step}: expected loss {loss}, got {got[step]}"
            )
