"""LocalSGD: period 1 is allreduce, period k keeps the replicas equal exactly on its schedule, and resumes.

The engine runs (torchrun, gloo) check the end-to-end results; a spawned 2-rank gloo group drives a real
Trainer step by step to see every rank's parameters after every step.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from pydantic import ValidationError

from api_schemas import EngineOptions, JobSpec
from tests.engine_fixtures import Launches
from workers.engine import distributed
from workers.engine.checkpoint import CheckpointManager, checkpoint_name
from workers.engine.local_sgd import averages_after
from workers.engine.recipes import mlp
from workers.engine.trainer import Trainer

# Period-1 parameter averaging equals gradient averaging by linearity (SGD with momentum and weight
# decay); only float rounding differs. 1e-6, the bound the other equivalence tests use.
TOLERANCE = 1e-6
WORLD = 2
STEPS = 8
# The schedule the spawned checks drive: averaging after ITER W + m*k = 5 and 8.
PERIOD, WARMUP = 3, 2
WARMUP_ITERS = {1, 2}
AVERAGING_ITERS = {5, 8}
LOCAL_ITERS = {3, 4, 6, 7}


@pytest.fixture
def launch(launched: Launches) -> Callable[..., Any]:
    """`launch(spec, nproc)` -> the finished run, launched once per session."""
    return launched.torchrun


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"expected the same state_dict keys, got {sorted(a)} vs {sorted(b)}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.e2e
class TestPeriodOne:
    """`local_sgd_period: 1` averages after every step: the same update as allreduce mode."""

    HP = {"steps": STEPS}  # make_spec's job: momentum 0.9, weight decay 1e-4, global batch 32

    def _final(
        self, launch: Callable[..., Any], make_spec: Callable[..., Any], nproc: int, **engine: Any
    ) -> dict[str, torch.Tensor]:
        run = launch(make_spec(hyperparameters=self.HP, engine=engine), nproc)
        return cast(dict[str, torch.Tensor], run.checkpoint(STEPS)["model"])

    def test_equals_allreduce_mode_at_world_2(
        self, launch: Callable[..., Any], make_spec: Callable[..., Any]
    ) -> None:
        local = self._final(launch, make_spec, WORLD, mode="local_sgd", local_sgd_period=1)
        allreduce = self._final(launch, make_spec, WORLD, mode="allreduce")
        diff = _max_diff(local, allreduce)
        print(f"local_sgd period 1 vs allreduce, world 2: max |param diff| {diff:.3g}")
        assert diff <= TOLERANCE, f"expected max |param diff| <= {TOLERANCE}, got {diff:.3g}"

    def test_equals_world_1(self, launch: Callable[..., Any], make_spec: Callable[..., Any]) -> None:
        local = self._final(launch, make_spec, WORLD, mode="local_sgd", local_sgd_period=1)
        one = self._final(launch, make_spec, 1, mode="local_sgd", local_sgd_period=1)
        diff = _max_diff(local, one)
        print(f"local_sgd period 1 world 2 vs world 1: max |param diff| {diff:.3g}")
        assert diff <= TOLERANCE, f"expected max |param diff| <= {TOLERANCE}, got {diff:.3g}"


@pytest.mark.e2e
class TestResume:
    """A job resumed from a checkpoint at an averaging step continues the same schedule."""

    # Momentum 0: plain SGD keeps no optimizer state, so rank 0's checkpoint is the whole state of every
    # rank at an averaging step (with momentum, rank 1's own momentum buffer is not in the checkpoint).
    HP = {"steps": STEPS, "momentum": 0.0}
    ENGINE = {"mode": "local_sgd", "local_sgd_period": PERIOD, "local_sgd_warmup_steps": WARMUP}
    CKPT = {"every_steps": 5, "keep_last": 3}  # ITER 5 is the first averaging step

    def test_resume_at_an_averaging_step_matches_the_uninterrupted_run(
        self,
        launch: Callable[..., Any],
        make_spec: Callable[..., Any],
        engine_runner: Callable[..., Any],
        tmp_path: Path,
    ) -> None:
        full = launch(make_spec(hyperparameters=self.HP, engine=self.ENGINE, checkpoint=self.CKPT), WORLD)
        ckpts = [e["step"] for e in full.events(0) if e["type"] == "checkpoint"]
        assert ckpts == [5, STEPS], f"expected checkpoints at [5, {STEPS}], got {ckpts}"
        fresh = tmp_path / "resumed-ckpts"
        fresh.mkdir()
        src = full.checkpoint_dir / checkpoint_name(5)
        for path in (src, CheckpointManager.sidecar_for(src)):
            shutil.copy(path, fresh / path.name)
        spec = json.loads((full.run_dir / "spec.json").read_text())
        resumed = engine_runner(spec, WORLD, checkpoint_dir=fresh)
        assert resumed.returncode == 0, f"resumed run: expected exit 0\n{resumed.describe()}"
        started = [e["start_iter"] for e in resumed.events(0) if e["type"] == "started"]
        assert started == [5], f"expected one start at iter 5, got {started}"
        want, got = full.checkpoint(STEPS)["model"], resumed.checkpoint(STEPS)["model"]
        for name, t in want.items():
            assert torch.equal(got[name], t), (
                f"{name}: expected bitwise equal to the uninterrupted run, max diff "
                f"{(got[name] - t).abs().max().item():.3g}"
            )


# ---- the schedule, on a spawned gloo group -----------------------------------------------------------------


def test_schedule_is_every_period_after_the_warmup() -> None:
    got = [it + 1 for it in range(12) if averages_after(it, period=PERIOD, warmup_steps=WARMUP)]
    assert got == [5, 8, 11], f"expected averaging after ITER [5, 8, 11], got {got}"
    got = [it + 1 for it in range(4) if averages_after(it, period=1, warmup_steps=0)]
    assert got == [1, 2, 3, 4], f"expected averaging after every step for period 1, got {got}"


def _trainer(env: distributed.DistEnv, **engine: Any) -> Trainer:
    spec = {
        "name": "local-sgd",
        "recipe": "mlp",
        "hyperparameters": {"global_batch_size": 16, "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
        "engine": {"collective_timeout_seconds": 60, **engine},
    }
    cfg = JobSpec.model_validate(spec)
    torch.manual_seed(0)
    plan = mlp.build({"dataset_size": 256}, 0)
    local = cfg.local_batch_size(env.world_size)
    return Trainer(
        cfg, plan, env, torch.device("cpu"), cast(Any, None), cast(Any, None), local_batch_size=local
    )


# Accumulation 2 too: a local step must skip the allreduce of its last micro-step as well.
SPAWN_CASES = {"accum1": 1, "accum2": 2}


def _worker(rank: int, world: int, out_dir: str) -> None:
    env = distributed.DistEnv(rank=rank, world_size=WORLD, launched=True)
    results: dict[str, list[list[torch.Tensor]]] = {}
    for case, accum in SPAWN_CASES.items():
        trainer = _trainer(
            env,
            mode="local_sgd",
            local_sgd_period=PERIOD,
            local_sgd_warmup_steps=WARMUP,
            grad_accumulation_steps=accum,
        )
        trainer.wrap()
        results[case] = []
        for it in range(STEPS):
            trainer._step(it)
            trainer.iter = it + 1
            results[case].append([p.detach().clone() for p in trainer.model.parameters()])
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture
def spawned(launched: Launches) -> list[dict[str, list[list[torch.Tensor]]]]:
    """Each rank's parameters after every step, per case (spawned once per session)."""
    return launched.gloo(_worker, WORLD)


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(SPAWN_CASES))
def test_replicas_are_equal_exactly_after_warmup_and_averaging_steps(
    spawned: list[dict[str, list[list[torch.Tensor]]]], case: str
) -> None:
    r0, r1 = spawned[0][case], spawned[1][case]
    equal = {
        it + 1 for it in range(STEPS) if all(torch.equal(a, b) for a, b in zip(r0[it], r1[it], strict=True))
    }
    expected = WARMUP_ITERS | AVERAGING_ITERS
    # Equality of the sets also proves the local steps were local: after ITER 3, 4, 6 and 7 the replicas
    # must differ, which they cannot if a gradient allreduce had run.
    assert equal == expected, (
        f"{case}: expected identical parameters on both ranks after ITER {sorted(expected)} "
        f"(warm-up {sorted(WARMUP_ITERS)}, averaging {sorted(AVERAGING_ITERS)}) and different after "
        f"{sorted(LOCAL_ITERS)}, got identical after {sorted(equal)}"
    )


# ---- config -----------------------------------------------------------------------------------------------


def test_engine_options_refuse_an_unknown_mode() -> None:
    with pytest.raises(ValidationError, match="mode\n  Input should be 'allreduce' or 'local_sgd'"):
        EngineOptions(mode="bogus")  # type: ignore[arg-type]
