"""bf16 autocast, gradient accumulation and gradient clipping keep the any-world-size math."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from api_schemas import EngineOptions, JobSpec
from tests.engine_fixtures import Launches

FP32_TOLERANCE = 1e-6  # same bound as test_equivalence: only reduction order differs
# bf16 keeps ~3 significant digits; world 2 rounds two half-batch weight gradients to bf16 where world 1
# rounds one full-batch gradient, so the runs drift apart. Measured after 10 steps: 2.0e-4 (max abs param
# diff), against 1.4e-3 between bf16 and fp32; 1e-3 allows 5x the measured drift and still tells bf16
# runs apart from an fp32 one.
BF16_TOLERANCE = 1e-3
CLIP_NORM = 0.05  # well under the mlp's ~0.5-2 gradient norm, so every step clips


@pytest.fixture
def launch(launched: Launches, make_spec: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
    """`launch(nproc, **engine)`: the equivalence job with these engine options, launched once per session."""
    return lambda nproc, **engine: launched.torchrun(make_spec(engine=engine), nproc)


def _params(run: Any) -> dict[str, torch.Tensor]:
    steps = max(e["step"] for e in run.events(0) if e["type"] == "metrics")
    return run.checkpoint(steps)["model"]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"expected the same parameter names, got {sorted(a)} vs {sorted(b)}"
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _metrics(run: Any, name: str) -> dict[int, float]:
    return {e["step"]: e["values"][name] for e in run.events(0) if e["type"] == "metrics"}


@pytest.mark.e2e
def test_accumulation_at_world_2_matches_world_1(launch: Callable[..., Any]) -> None:
    ref, accum = launch(1), launch(2, grad_accumulation_steps=2)
    diff = _max_diff(_params(accum), _params(ref))
    print(f"accumulation 2 @ world 2 vs world 1: max |param diff| = {diff:.3g}")
    assert diff <= FP32_TOLERANCE, f"expected max |param diff| <= {FP32_TOLERANCE}, got {diff:.3g}"
    ref_loss, got_loss = _metrics(ref, "loss"), _metrics(accum, "loss")
    assert got_loss.keys() == ref_loss.keys(), f"expected steps {sorted(ref_loss)}, got {sorted(got_loss)}"
    for step, loss in ref_loss.items():
        assert abs(got_loss[step] - loss) <= 1e-5, f"step {step}: expected loss {loss}, got {got_loss[step]}"


@pytest.mark.e2e
def test_clipping_matches_across_world_sizes_and_clips(launch: Callable[..., Any]) -> None:
    one, two = launch(1, grad_clip_norm=CLIP_NORM), launch(2, grad_clip_norm=CLIP_NORM)
    for w, run in ((1, one), (2, two)):
        norms = _metrics(run, "grad_norm")
        print(f"clip {CLIP_NORM} @ world {w}: grad_norm {norms}")
        assert norms and min(norms.values()) > CLIP_NORM, (
            f"world {w}: expected grad_norm > {CLIP_NORM} on every logging step (clipping acted), got {norms}"
        )
    diff = _max_diff(_params(two), _params(one))
    print(f"clip {CLIP_NORM} @ world 2 vs world 1: max |param diff| = {diff:.3g}")
    assert diff <= FP32_TOLERANCE, f"expected max |param diff| <= {FP32_TOLERANCE}, got {diff:.3g}"
    unclipped = _max_diff(_params(one), _params(launch(1)))
    print(f"clip {CLIP_NORM} vs no clipping @ world 1: max |param diff| = {unclipped:.3g}")
    assert unclipped > 1e-3, f"expected clipping to change the result, max |param diff| was {unclipped:.3g}"
    unclipped_metrics = [e["values"] for e in launch(1).events(0) if e["type"] == "metrics"]
    assert all("grad_norm" not in v for v in unclipped_metrics), (
        f"expected no grad_norm metric when clipping is off, got {unclipped_metrics}"
    )


@pytest.mark.e2e
def test_bf16_matches_across_world_sizes_and_differs_from_fp32(launch: Callable[..., Any]) -> None:
    one, two = launch(1, precision="bf16"), launch(2, precision="bf16")
    diff = _max_diff(_params(two), _params(one))
    print(f"bf16 @ world 2 vs world 1: max |param diff| = {diff:.3g}")
    assert diff <= BF16_TOLERANCE, f"expected max |param diff| <= {BF16_TOLERANCE}, got {diff:.3g}"
    vs_fp32 = _max_diff(_params(one), _params(launch(1)))
    print(f"bf16 vs fp32 @ world 1: max |param diff| = {vs_fp32:.3g}")
    # fp32 runs agree to ~1e-8, so anything this large means autocast really computed in bf16.
    assert vs_fp32 > 1e-4, f"expected bf16 to differ from fp32 (autocast active), got {vs_fp32:.3g}"
    assert all(p.dtype == torch.float32 for p in _params(one).values()), "expected fp32 master params"


def test_accumulation_must_divide_the_local_batch(make_spec: Callable[..., dict[str, Any]]) -> None:
    spec = JobSpec.model_validate(
        make_spec(hyperparameters={"global_batch_size": 12}, engine={"grad_accumulation_steps": 4})
    )
    assert spec.local_batch_size(1) == 12
    with pytest.raises(ValueError, match="world size 2 x engine.grad_accumulation_steps 4 = 8"):
        spec.local_batch_size(2)  # a local batch of 6 has no four equal micro-batches
    four = JobSpec.model_validate(make_spec(engine={"grad_accumulation_steps": 4}))
    assert four.local_batch_size(2) == 16


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("precision", "fp16", "engine.precision"),
        ("grad_accumulation_steps", 0, "engine.grad_accumulation_steps"),
        ("grad_clip_norm", 0, "engine.grad_clip_norm"),
        ("grad_clip_norm", True, "engine.grad_clip_norm"),
    ],
)
def test_engine_options_refuse_bad_values(option: str, value: Any, match: str) -> None:
    with pytest.raises(ValidationError) as raised:
        EngineOptions.model_validate({option: value})
    assert [e["loc"] for e in raised.value.errors()] == [(match.removeprefix("engine."),)], raised.value
