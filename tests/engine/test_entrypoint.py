"""User code through `entrypoint` and the non-finite-loss failure."""

from __future__ import annotations

import re
from typing import Any

import pytest

from workers.engine.recipes import load_entrypoint

ALLOWED = {"DPTRAIN_ALLOWED_ENTRYPOINTS": "examples"}


def _entrypoint_spec(make_spec: Any, **hp: Any) -> dict[str, Any]:
    spec = make_spec(hyperparameters={"lr": 0.01, "steps": 6, **hp}, checkpoint={"every_steps": 3})
    spec["recipe"] = None
    spec["entrypoint"] = "examples.custom_plan:build"
    return dict(spec)


@pytest.mark.e2e  # torchrun
def test_the_example_entrypoint_trains_the_same_at_world_1_and_2(engine_runner: Any, make_spec: Any) -> None:
    spec = _entrypoint_spec(make_spec, features=8)
    runs = {w: engine_runner(spec, w, extra_env=ALLOWED) for w in (1, 2)}
    for w, run in runs.items():
        assert run.returncode == 0, f"world {w}: expected rc 0\n{run.describe()}"
    one, two = runs[1].checkpoint(6), runs[2].checkpoint(6)
    diff = max(float((one["model"][k] - two["model"][k]).abs().max()) for k in one["model"])
    assert diff <= 1e-6, f"AdamW entrypoint: world 2 differs from world 1 by {diff:.3e} (allowed 1e-6)"
    assert one["lr_scheduler"]["last_epoch"] == 6, "the schedule stepped once per optimizer step"
    lrs = [e["values"]["lr"] for e in runs[1].events(0) if e["type"] == "metrics"]
    assert lrs[0] > lrs[-1], f"StepLR should have lowered the lr, got {lrs}"


@pytest.mark.e2e  # torchrun
def test_an_entrypoint_outside_the_allowed_prefixes_never_runs(engine_runner: Any, make_spec: Any) -> None:
    run = engine_runner(_entrypoint_spec(make_spec), 1, extra_env={"DPTRAIN_ALLOWED_ENTRYPOINTS": "team_a"})
    assert run.returncode != 0
    errors = [e for e in run.events(0) if e["type"] == "error"]
    assert errors and errors[0]["error_type"] == "PermissionError", errors
    assert "not under an allowed prefix" in errors[0]["message"]
    with pytest.raises(PermissionError):
        load_entrypoint("os:system", allowed="")


@pytest.mark.e2e  # torchrun
def test_a_non_finite_loss_fails_the_job_naming_step_and_rank(engine_runner: Any, make_spec: Any) -> None:
    # An absurd learning rate makes the loss overflow within a few steps on every rank.
    spec = make_spec(hyperparameters={"lr": 100.0, "momentum": 0.9, "steps": 50})
    run = engine_runner(spec, 2)
    assert run.returncode != 0, "a diverged job must fail"
    errors = [e for r in (0, 1) for e in run.events(r) if e["type"] == "error"]
    assert errors, f"expected an error event\n{run.describe()}"
    first = min(errors, key=lambda e: e["time"])
    assert first["error_type"] == "FloatingPointError", first
    named = re.search(r"non-finite loss at step \d+ on ranks? ([0-9, ]+):", first["message"])
    assert named, first["message"]
    assert set(named.group(1).split(", ")) <= {"0", "1"}, first["message"]
    assert not [e for e in run.events(0) if e["type"] == "finished"]


@pytest.mark.parametrize(
    "name",
    [
        "examples.custom_plan:TensorDataset",  # a class the module imported, not a function it defines
        "examples.custom_plan:Plan",  # imported from dptrain
        "examples.custom_plan:_dataset",  # private
        "examples.custom_plan:missing",
        "examples.mlp:build",  # no such module function (mlp.yaml is not a module)
    ],
)
def test_only_a_public_function_defined_in_the_named_module_is_loaded(name: str) -> None:
    with pytest.raises((ValueError, ModuleNotFoundError)):
        load_entrypoint(name, allowed="examples")
    assert callable(load_entrypoint("examples.custom_plan:build", allowed="examples"))


@pytest.mark.e2e  # torchrun
def test_the_own_loss_example_trains_evaluates_and_keeps_its_best(engine_runner: Any, make_spec: Any) -> None:
    spec = make_spec(
        hyperparameters={"lr": 3e-3, "weight_decay": 0.1, "steps": 30, "global_batch_size": 16},
        evaluation={"every_steps": 10, "max_batches": 4},
        checkpoint={"every_steps": 10, "keep_last": 1, "keep_best": {"metric": "eval/loss", "mode": "min"}},
    )
    spec["recipe"] = None
    spec["entrypoint"] = "examples.own_loss:build"
    run = engine_runner(spec, 2, extra_env=ALLOWED)
    assert run.returncode == 0, run.describe()
    evals = {
        e["step"]: e["values"] for e in run.events(0) if e["type"] == "metrics" and "eval/loss" in e["values"]
    }
    assert sorted(evals) == [10, 20, 30]
    assert evals[30]["eval/loss"] < evals[10]["eval/loss"], evals
    assert set(evals[30]) == {"eval/loss", "eval/next_token_accuracy"}
    groups = run.checkpoint(30)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0], "configure_optimizers' decay/no-decay groups"
