"""Event stream sanity, config validation, sampler determinism, and the torch-free launcher helper."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from workers.engine.config import JobConfig
from workers.engine.data import GlobalBatchSampler
from workers.engine.faults import parse_fault
from workers.engine.recipes import RECIPES

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.parametrize("world", [1, 2, 4])
def test_event_stream(equivalence_runs: dict[int, Any], equivalence_spec: dict[str, Any], world: int) -> None:
    run = equivalence_runs[world]
    steps = equivalence_spec["hyperparameters"]["steps"]
    events = run.events(0)
    types = [e["type"] for e in events]
    assert types[0] == "started" and types[-1] == "finished", f"expected started...finished, got {types}"
    assert all(isinstance(e["time"], float) for e in events), "every event needs a unix float time"
    started = events[0]
    want = {"world_size": world, "start_iter": 0, "total_steps": steps, "device": "cpu", "backend": "gloo"}
    assert {k: started[k] for k in want} == want, f"expected started {want}, got {started}"
    metrics = [e for e in events if e["type"] == "metrics"]
    assert [m["step"] for m in metrics] == [5, 10], f"expected metrics at [5, 10], got {metrics}"
    for m in metrics:
        vals = m["values"]
        assert set(vals) == {"loss", "lr", "samples_per_s", "step_time_s"}, f"unexpected metrics {vals}"
        assert math.isfinite(vals["loss"]) and vals["samples_per_s"] > 0 and vals["step_time_s"] > 0, vals
    ckpts = [e for e in events if e["type"] == "checkpoint"]
    assert [c["step"] for c in ckpts] == [steps], f"expected only the last-step checkpoint, got {ckpts}"
    data = Path(ckpts[0]["path"]).read_bytes()
    assert ckpts[0]["sha256"] == hashlib.sha256(data).hexdigest(), "event sha256 differs from the file's"
    assert ckpts[0]["size_bytes"] == len(data) and ckpts[0]["deleted"] == []
    assert events[-1]["step"] == steps, f"expected finished at step {steps}, got {events[-1]}"
    for rank in range(1, world):
        assert run.events(rank) == [], (
            f"rank {rank} should write no events on success, got {run.events(rank)}"
        )
        assert f"rank {rank} done" in run.log(rank), f"expected rank {rank}'s log to be captured"


def test_config_validation(make_spec: Any) -> None:
    cfg = JobConfig.from_spec(make_spec(hyperparameters={"global_batch_size": 30, "hidden_size": 8}))
    assert cfg.recipe_params == {"hidden_size": 8} and cfg.local_batch_size(2) == 15
    with pytest.raises(ValueError, match="not divisible by the world size 4"):
        cfg.local_batch_size(4)
    with pytest.raises(ValueError, match="lr"):
        JobConfig.from_spec(make_spec(hyperparameters={"lr": 0}))
    with pytest.raises(ValueError, match="unknown engine option"):
        JobConfig.from_spec(make_spec(engine={"bucket_cap": 1}))
    with pytest.raises(ValueError, match="not a hyperparameter of recipe 'mlp'"):
        RECIPES["mlp"]({"depth": 3}, 0)


def test_sampler_is_a_pure_function_of_iter() -> None:
    a, b = GlobalBatchSampler(10, 4, seed=5), GlobalBatchSampler(10, 4, seed=5)
    stream = [int(i) for it in range(5) for i in a.global_indices(it)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10)), stream
    assert b.global_indices(3).tolist() == a.global_indices(3).tolist(), "expected no hidden sampler state"
    for world in (1, 2, 4):
        parts = [a.local_indices(2, r, world).tolist() for r in range(world)]
        assert sum(parts, []) == a.global_indices(2).tolist(), f"world {world}: slices do not tile the batch"


def test_fault_parser() -> None:
    f = parse_fault("raise:rank=1:step=3")
    assert f is not None and (f.action, f.rank, f.step) == ("raise", 1, 3)
    assert parse_fault("") is None
    with pytest.raises(ValueError):
        parse_fault("raise:when=3")


@pytest.mark.e2e
def test_launch_helper_does_not_import_torch() -> None:
    code = (
        "import sys; from workers.engine.launch import torchrun_command as t; "
        "assert 'torch' not in sys.modules; "
        "print(t(job_id='j', nproc=2, spec_path='s', run_dir='r', checkpoint_dir='c'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"expected a torch-free import, got {out.stderr}"
    assert "'--nproc-per-node=2', '--start-method=fork', '--run-path'" in out.stdout, out.stdout
