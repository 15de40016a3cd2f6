"""Models as people write them, through entrypoints: each calling convention at world 1 and 2,
evaluation equal at world 1, 2 and 3, keep_best across a kill and resume, an injected NaN."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine_fixtures import EngineRun, Launches
from tests.fixtures import plans
from workers.engine.batch_sampler import batch_source
from workers.engine.checkpoint import checkpoint_files, read_best_step
from workers.engine.conventions import loss_and_outputs
from workers.engine.distributed import DistEnv
from workers.engine.evaluation import Evaluator

ALLOWED = {"DPTRAIN_ALLOWED_ENTRYPOINTS": "tests.fixtures"}
SGD_TOLERANCE = 1e-6


def _spec(make_spec: Any, entrypoint: str, **sections: Any) -> dict[str, Any]:
    spec = make_spec(hyperparameters={"global_batch_size": 12, "lr": 0.05, "steps": 6}, **sections)
    spec["recipe"] = None
    spec["entrypoint"] = f"tests.fixtures.plans:{entrypoint}"
    return dict(spec)


def _final(run: EngineRun) -> dict[str, torch.Tensor]:
    state = run.checkpoint(max(checkpoint_files(run.checkpoint_dir)))
    return {k: v for k, v in state["model"].items() if v.is_floating_point()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# The default eval batch: 3 global batches of 12 (36 of the 50 eval samples) at any world size, split
# 12, 6 + 6 and 4 + 4 + 4 over the ranks.
GPT_EVAL = {"evaluation": {"every_steps": 3, "max_batches": 3}}
# Each rank's part of a global batch has another size at each world size, so its float32 mean loss
# rounds differently: ~1.2e-7 relative of losses ~2.8 (measured: within 8e-8, weights' differences
# included). 1e-6 keeps a margin and is far below what evaluating other samples moves (18 and 12 of
# them at world 2 and 3 when the default batch was the local one: 3.5e-2).
SPLIT_TOLERANCE = 1e-6


@pytest.mark.e2e  # torchrun
@pytest.mark.parametrize(
    ("entrypoint", "sections"),
    [("gpt_like", GPT_EVAL), ("dict_batches", {}), ("padded", {})],
    ids=["forward-returns-its-loss", "dict-batches", "custom-collate-fn"],
)
def test_each_calling_convention_ends_with_the_same_parameters_at_world_1_and_2(
    launched: Launches, make_spec: Any, entrypoint: str, sections: dict[str, Any]
) -> None:
    spec = _spec(make_spec, entrypoint, **sections)
    one, two = (launched.torchrun(spec, w, extra_env=ALLOWED) for w in (1, 2))
    diff = _max_diff(_final(one), _final(two))
    assert diff <= SGD_TOLERANCE, f"{entrypoint}: world 1 and 2 differ by {diff}"
    losses = [e["values"]["loss"] for e in one.events(0) if e["type"] == "metrics" and "loss" in e["values"]]
    assert losses and all(torch.isfinite(torch.tensor(losses))), losses


@pytest.mark.e2e  # torchrun
def test_the_optimizer_factory_gets_the_model_for_parameter_groups(
    launched: Launches, make_spec: Any
) -> None:
    run = launched.torchrun(_spec(make_spec, "gpt_like", **GPT_EVAL), 1, extra_env=ALLOWED)
    groups = run.checkpoint(6)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [pytest.approx(1e-4), 0.0], groups


def _eval_figures(run: EngineRun) -> dict[int, dict[str, float]]:
    return {
        e["step"]: e["values"]
        for e in run.events(0)
        if e["type"] == "metrics" and any(k.startswith("eval/") for k in e["values"])
    }


@pytest.mark.e2e  # torchrun
def test_evaluation_figures_are_equal_at_world_1_2_and_3_and_to_a_single_process_reference(
    launched: Launches, make_spec: Any
) -> None:
    spec = _spec(make_spec, "gpt_like", **GPT_EVAL)
    runs = {w: launched.torchrun(spec, w, extra_env=ALLOWED) for w in (1, 2, 3)}
    figures = {w: _eval_figures(r) for w, r in runs.items()}
    assert sorted(figures[1]) == [3, 6], "every `every_steps` and at the end"
    for w in (2, 3):
        assert figures[w].keys() == figures[1].keys()
        for step, values in figures[1].items():
            assert values.keys() == {"eval/loss", "eval/last_token_accuracy"}
            print(f"world {w} step {step}: {figures[w][step]} vs world 1 {values}")
            for name, value in values.items():
                assert figures[w][step][name] == pytest.approx(value, abs=SPLIT_TOLERANCE), (w, step, name)
    # The reference: the final weights, evaluated in this process global batch by global batch.
    plan = plans.gpt_like({"global_batch_size": 12, "weight_decay": 0.0, "lr": 0.05}, 1234, _ctx())
    plan.model.load_state_dict(runs[1].checkpoint(6)["model"])
    plan.model.eval()
    loss_sum, hits, n = 0.0, 0.0, 0
    data = batch_source(plan.eval_dataset, None)
    with torch.no_grad():
        for start in range(0, 36, 12):
            batch = data.batch(torch.arange(start, start + 12), torch.device("cpu"))
            loss, model = loss_and_outputs(plan, plan.model, batch)
            assert plan.eval_metrics is not None
            ((h, count),) = plan.eval_metrics(model, batch).values()
            loss_sum, hits, n = loss_sum + float(loss) * count, hits + float(h), n + count
    assert n == 36
    assert figures[1][6]["eval/loss"] == pytest.approx(loss_sum / n, abs=1e-6)
    assert figures[1][6]["eval/last_token_accuracy"] == pytest.approx(hits / n, abs=1e-9)


def _ctx() -> Any:
    from dptrain import BuildContext

    return BuildContext(device=torch.device("cpu"), world_size=1, rank=0, local_batch_size=12)


def _evaluator(rank: int, world: int, batch_size: int, *, split: bool, lockstep: bool = False) -> Evaluator:
    plan = plans.peaked({"peak_step": 1}, 0)  # 64 eval samples
    ev = Evaluator(
        plan=plan,
        dataset=batch_source(plan.eval_dataset, None),
        env=DistEnv(rank=rank, world_size=world, local_rank=rank),
        device=torch.device("cpu"),
        batch_size=batch_size,
        max_batches=None,
        autocast=lambda: torch.autocast("cpu", enabled=False),
        split=split,
    )
    ev.lockstep = lockstep
    return ev


def test_the_evaluator_splits_batches_round_robin_and_pads_lockstep_rounds() -> None:
    ev = _evaluator(1, 3, 10, split=False)
    assert ev.batches == 7 and ev.my_parts() == [(10, 20), (40, 50)]  # 7 batches, the last of 4
    assert _evaluator(1, 3, 10, split=False, lockstep=True).my_parts() == [(10, 20), (40, 50), (0, 0)]


def test_the_evaluator_splits_each_global_batch_over_the_ranks() -> None:
    # 64 samples in global batches of 12: five whole ones and one of 4, split 2 + 1 + 1 at world 3.
    parts = {r: _evaluator(r, 3, 12, split=True).my_parts() for r in range(3)}
    assert parts[0][:2] == [(0, 4), (12, 16)] and parts[0][-1] == (60, 62)
    assert parts[1][-1] == (62, 63) and parts[2][-1] == (63, 64)
    covered = sorted(i for r in parts.values() for a, b in r for i in range(a, b))
    assert covered == list(range(64)), "expected every sample once"
    # 4 samples over 5 ranks: the last rank's part of the last batch is empty, kept only in lockstep.
    assert _evaluator(4, 5, 12, split=True).my_parts()[-1] == (58, 60), "12 = 3 + 3 + 2 + 2 + 2"
    lockstep = _evaluator(4, 5, 12, split=True, lockstep=True).my_parts()
    assert len(lockstep) == 6 and lockstep[-1] == (64, 64), "one part per global batch, the last empty"
    assert _evaluator(0, 5, 12, split=True).my_parts()[-1] == (60, 61), "rank 0 always has samples"


@pytest.mark.e2e  # torchrun
def test_keep_best_keeps_the_best_checkpoint_across_a_kill_and_resume(
    engine_runner: Any, make_spec: Any, tmp_path: Path
) -> None:
    spec = _spec(
        make_spec,
        "peaked",
        evaluation={"every_steps": 2},
        checkpoint={"every_steps": 2, "keep_last": 1, "keep_best": {"metric": "eval/score", "mode": "max"}},
    )
    spec["hyperparameters"].update(steps=10, peak_step=4, global_batch_size=8)
    ckpt = tmp_path / "ckpt"
    # Killed (no error event, like a lost node) at the start of step 7: saved 2, 4 (best), 6.
    first = engine_runner(
        spec, 2, checkpoint_dir=ckpt, extra_env={**ALLOWED, "DPTRAIN_FAULT_INJECT": "exit:step=6"}
    )
    assert first.returncode != 0
    assert sorted(checkpoint_files(ckpt)) == [4, 6] and read_best_step(ckpt) == 4
    best_events = [e["step"] for e in first.events(0) if e["type"] == "checkpoint" and e["best"]]
    assert best_events == [2, 4]
    second = engine_runner(spec, 1, checkpoint_dir=ckpt, extra_env=ALLOWED)
    assert second.returncode == 0, second.describe()
    assert sorted(checkpoint_files(ckpt)) == [4, 10], "keep_last 1, plus the best"
    assert read_best_step(ckpt) == 4
    assert not [e for e in second.events(0) if e["type"] == "checkpoint" and e["best"]]
    final = second.checkpoint(10)
    assert final["best"] == {"step": 4, "value": 0.0}
    assert int(second.checkpoint(4)["model"]["trained"]) == 4


@pytest.mark.e2e  # torchrun
def test_a_nan_at_step_k_fails_the_job_naming_step_and_rank_and_no_checkpoint_holds_it(
    engine_runner: Any, make_spec: Any
) -> None:
    spec = _spec(make_spec, "nan_at", checkpoint={"every_steps": 2}, engine={"log_every_steps": 1})
    spec["hyperparameters"].update(steps=8, nan_step=3, nan_rank=1, global_batch_size=8)
    run = engine_runner(spec, 2, extra_env=ALLOWED)
    assert run.returncode != 0
    errors = [e for r in (0, 1) for e in run.events(r) if e["type"] == "error"]
    assert errors and all(e["error_type"] == "FloatingPointError" for e in errors), run.describe()
    assert all("non-finite loss at step 3 on rank 1:" in e["message"] for e in errors), errors
    assert sorted(checkpoint_files(run.checkpoint_dir)) == [2], "nothing saved after the bad step"
    weights = run.checkpoint(2)["model"]
    assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())
