"""Batches through torch's DataLoader: loader processes change nothing in the math at any world size, a
kill mid-epoch resumes bitwise with them, and a sample that fails to load fails the job, naming the rank
and the sample, with no process left behind."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine_fixtures import EngineRun, Launches, assert_bitwise_equal, assert_no_process_left
from workers.engine.batch_loader import Batches, fixed_batch_sampler, loader_options, map_loader
from workers.engine.batch_sampler import GlobalBatchSampler
from workers.engine.stream_batches import StreamBatch

ALLOWED = {"DPTRAIN_ALLOWED_ENTRYPOINTS": "tests.fixtures"}
WORKERS = {"num_workers": 2, "prefetch_factor": 3}


def _with(spec: dict[str, Any], **data: Any) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    spec["data"] = {**spec.get("data", {}), **data}
    return spec


def _ok(run: EngineRun) -> EngineRun:
    assert run.returncode == 0, run.describe()
    return run


@pytest.mark.e2e
@pytest.mark.parametrize("world", [1, 2, 4])
def test_loader_processes_give_bitwise_the_parameters_of_loading_in_the_rank(
    launched: Launches, equivalence_runs: dict[int, EngineRun], equivalence_spec: dict[str, Any], world: int
) -> None:
    steps = equivalence_spec["hyperparameters"]["steps"]
    with_workers = _ok(launched.torchrun(_with(equivalence_spec, **WORKERS), world))
    want, got = equivalence_runs[world].checkpoint(steps), with_workers.checkpoint(steps)
    # The same batches in the same order, whoever loads them: the same floats, not just close ones.
    assert_bitwise_equal(want["model"], got["model"], f"world {world} model")
    assert_bitwise_equal(want["optimizer"]["state"], got["optimizer"]["state"], f"world {world} optimizer")
    # And so, as without loader processes, within 1e-6 of world 1's.
    one = equivalence_runs[1].checkpoint(steps)["model"]
    assert max(float((got["model"][k] - one[k]).abs().max()) for k in one) <= 1e-6


@pytest.mark.e2e
def test_a_kill_mid_epoch_resumes_bitwise_with_loader_processes(
    launched: Launches, engine_runner: Any, make_spec: Any, tmp_path: Path
) -> None:
    # 100 samples, batches of 32: the checkpoint at step 4 falls 28 samples into the second epoch.
    spec = _with(
        make_spec(
            hyperparameters={"steps": 9, "dataset_size": 100},
            checkpoint={"every_steps": 4, "keep_last": 3},
        ),
        **WORKERS,
    )
    full = _ok(launched.torchrun(spec, 2))
    ckpt = tmp_path / "ckpt"
    killed = engine_runner(
        spec, 2, checkpoint_dir=ckpt, extra_env={"DPTRAIN_FAULT_INJECT": "exit:rank=0:step=6"}
    )
    assert killed.returncode != 0, killed.describe()
    resumed = _ok(engine_runner(spec, 2, checkpoint_dir=ckpt))
    assert [e["start_iter"] for e in resumed.events(0) if e["type"] == "started"] == [4]
    want, got = full.checkpoint(9), resumed.checkpoint(9)
    for key in ("model", "optimizer", "iter"):
        assert_bitwise_equal(want[key], got[key], key)
    assert_no_process_left(killed.job_id)


@pytest.mark.e2e
def test_a_sample_that_fails_to_load_fails_the_job_naming_rank_and_sample(
    engine_runner: Any, make_spec: Any
) -> None:
    bad, size, batch, seed = 40, 64, 12, 1234
    spec = make_spec(
        hyperparameters={"global_batch_size": batch, "steps": 8, "bad_sample": bad, "dataset_size": size}
    )
    spec.update(recipe=None, entrypoint="tests.fixtures.data_plans:fragile")
    run = engine_runner(_with(spec, num_workers=2), 2, extra_env=ALLOWED)
    assert run.returncode != 0, run.describe()

    # Where sample 40 falls: the first step whose global batch holds it, and the rank whose half it is.
    sampler = GlobalBatchSampler(size, batch, seed)
    step = next(it for it in range(8) if bad in sampler.global_indices(it).tolist())
    rank = next(r for r in range(2) if bad in sampler.local_indices(step, r, batch // 2).tolist())
    errors = [e for e in run.events(rank) if e["type"] == "error"]
    assert [e["error_type"] for e in errors] == ["DataLoadError"], run.describe()
    message = errors[0]["message"]
    assert re.fullmatch(
        rf"rank {rank}: reading sample {bad} for step {step} failed: ValueError: corrupt record \(pid \d+\)",
        message,
    ), message
    # The record was read in a loader process, not in the rank itself.
    rank_pid = re.search(r"pid=(\d+)", run.log(rank))
    assert rank_pid is not None and f"(pid {rank_pid.group(1)})" not in message, (message, run.log(rank))
    assert "Traceback" in run.log(rank) and f"loading sample {bad} for step {step} failed" in run.log(rank)
    assert_no_process_left(run.job_id)


def test_an_evaluation_loader_reads_fixed_batches_on_every_pass() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10))
    batches = [torch.tensor([0, 1, 2]), torch.tensor([9])]
    loader = map_loader(data, None, fixed_batch_sampler(batches), {"collate_fn": lambda b: b})
    for _ in range(2):
        got = Batches(loader, device=torch.device("cpu"), rank=0, first=0)
        assert got.take()[1].tolist() == [0, 1, 2] and got.take()[1].tolist() == [9]


def test_loader_options_follow_the_spec() -> None:
    from api_schemas.data import DataSpec

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    none = loader_options(DataSpec(), cpu, seed=1)
    assert (none["num_workers"], none["pin_memory"]) == (0, False) and "prefetch_factor" not in none
    assert loader_options(DataSpec(), cuda, seed=1)["pin_memory"] is True  # pinned by default on a GPU
    spec = DataSpec(num_workers=2, prefetch_factor=4, persistent_workers=True, pin_memory=False)
    train, evaluation = (
        loader_options(spec, cuda, seed=1),
        loader_options(spec, cuda, seed=1, persistent=True),
    )
    assert (train["prefetch_factor"], train["persistent_workers"], train["pin_memory"]) == (4, False, False)
    assert evaluation["persistent_workers"] is True  # the evaluation loader is the one used more than once


def test_a_stream_batch_carries_its_position_through_the_loader() -> None:
    item = StreamBatch(
        (torch.zeros(2, 3), torch.zeros(2)), {"sample": 4, "epoch": 0, "shard": 1, "offset": 2}
    )
    got = Batches(iter([item]), device=torch.device("cpu"), rank=0, first=0)  # type: ignore[arg-type]
    batch = got.take()
    assert batch[0].shape == (2, 3) and got.position == item.position
