"""The `lstm_lm` recipe: the seeds' data-parallel LSTM trains to the same parameters at 1, 2 and 4 ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from workers.engine.recipes import RECIPES

TOLERANCE = 1e-6
STEPS = 6
WORLDS = (1, 2, 4)


def _spec(make_spec: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    spec = make_spec(
        hyperparameters={
            "global_batch_size": 16,
            "lr": 0.5,
            "momentum": 0.9,
            "weight_decay": 1e-4,
            "steps": STEPS,
            "seed": 4321,
        },
        engine={"log_every_steps": 1},
    )
    spec["recipe"] = "lstm_lm"
    return spec


def test_recipe_refuses_unknown_and_bad_extras() -> None:
    for bad, field in (
        ({"bogus": 1}, "bogus"),
        ({"vocab_size": 1}, "vocab_size"),
        ({"seq_len": 8.0}, "seq_len"),
    ):
        with pytest.raises(ValidationError) as refused:
            RECIPES["lstm_lm"](bad, 0)
        assert [e["loc"] for e in refused.value.errors()] == [(field,)], refused.value


def test_dataset_is_a_function_of_the_seed() -> None:
    a, b, c = (RECIPES["lstm_lm"]({"dataset_size": 64}, s).dataset for s in (1, 1, 2))
    assert a.inputs.shape == (64, 16) and a.inputs.dtype == torch.long
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)
    # Targets are the inputs shifted by one token.
    assert torch.equal(a.inputs[:, 1:], a.targets[:, :-1])


def _losses(run: Any) -> dict[int, float]:
    return {e["step"]: e["values"]["loss"] for e in run.events(0) if e["type"] == "metrics"}


@pytest.mark.e2e
def test_same_result_at_any_world_size(
    engine_runner: Callable[..., Any], make_spec: Callable[..., dict[str, Any]]
) -> None:
    spec = _spec(make_spec)
    runs = {w: engine_runner(spec, w) for w in WORLDS}
    for w, run in runs.items():
        assert run.returncode == 0, f"world {w}: expected torchrun to exit 0\n{run.describe()}"

    hp = spec["hyperparameters"]
    torch.manual_seed(hp["seed"])
    init = RECIPES["lstm_lm"]({}, hp["seed"]).model.state_dict()
    finals = {w: run.checkpoint(STEPS) for w, run in runs.items()}
    ref = finals[1]["model"]
    assert set(ref) == set(init), f"expected keys {sorted(init)}, got {sorted(ref)}"
    moved = max((ref[k] - init[k]).abs().max().item() for k in ref)
    assert moved > 1e-4, f"expected training to move the parameters, max change was {moved:.3g}"
    for w, state in finals.items():
        assert state["iter"] == STEPS, f"world {w}: expected iter {STEPS}, got {state['iter']}"
        diff = max((t - ref[name]).abs().max().item() for name, t in state["model"].items())
        print(f"lstm_lm world {w} vs world 1: max |param diff| = {diff:.3g}, losses {_losses(runs[w])}")
        assert diff <= TOLERANCE, (
            f"world {w} vs world 1: expected max |param diff| <= {TOLERANCE}, got {diff:.3g}"
        )

    ref_loss = _losses(runs[1])
    assert ref_loss, "expected metrics events from the world-1 run, got none"
    first, last = ref_loss[min(ref_loss)], ref_loss[max(ref_loss)]
    assert last < first, f"expected the loss to fall over {STEPS} steps, got {first} -> {last}"
    for w, run in runs.items():
        got = _losses(run)
        assert got.keys() == ref_loss.keys(), (
            f"world {w}: expected metrics at {sorted(ref_loss)}, got {sorted(got)}"
        )
        for step, loss in ref_loss.items():
            assert abs(got[step] - loss) <= 1e-5, (
                f"world {w} step {step}: expected loss {loss}, got {got[step]}"
            )
