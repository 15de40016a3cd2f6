"""Helpers for engine tests: write a spec, run the engine under torchrun, read its events and checkpoints."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.engine.launch import torchrun_command

REPO = Path(__file__).resolve().parents[2]
TORCHRUN_TIMEOUT_S = 120


def make_spec(**sections: dict[str, Any]) -> dict[str, Any]:
    """A JobSpec-shaped dict for the mlp recipe; each keyword updates that section."""
    spec: dict[str, Any] = {
        "name": "engine-test",
        "recipe": "mlp",
        "hyperparameters": {
            "global_batch_size": 32,
            "lr": 0.05,
            "momentum": 0.9,
            "weight_decay": 1e-4,
            "steps": 10,
            "seed": 1234,
        },
        "resources": {"nodes": 1, "processes_per_node": 1, "device": "cpu"},
        "engine": {"bucket_cap_mb": 25.0, "log_every_steps": 5, "collective_timeout_seconds": 60},
        "checkpoint": {"every_steps": 100, "keep_last": 3},
        "labels": {"suite": "engine"},
        "priority": 0,
    }
    spec = copy.deepcopy(spec)
    for name, values in sections.items():
        spec[name].update(values)
    return spec


@dataclass
class EngineRun:
    """One finished engine launch."""

    job_id: str
    run_dir: Path
    checkpoint_dir: Path
    returncode: int
    output: str

    def events(self, rank: int = 0) -> list[dict[str, Any]]:
        """Events rank `rank` wrote (empty if none)."""
        path = self.run_dir / "events" / f"rank{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def log(self, rank: int = 0) -> str:
        """Rank `rank`'s captured stdout/stderr."""
        path = self.run_dir / "logs" / f"rank{rank}.log"
        return path.read_text() if path.exists() else ""

    def checkpoint(self, step: int) -> dict[str, Any]:
        """The checkpoint for `step`, loaded the only allowed way."""
        path = self.checkpoint_dir / f"ckpt-{step:09d}.pt"
        assert path.exists(), f"expected checkpoint {path}, found {sorted(os.listdir(self.checkpoint_dir))}"
        return torch.load(path, weights_only=True, map_location="cpu")

    def describe(self) -> str:
        """Everything useful for a failure message."""
        logs = "\n".join(f"--- rank{r}.log ---\n{self.log(r)[-3000:]}" for r in range(4) if self.log(r))
        return f"rc={self.returncode}\n--- torchrun output ---\n{self.output[-3000:]}\n{logs}"


def run_engine(
    base: Path,
    spec: dict[str, Any],
    nproc: int,
    *,
    checkpoint_dir: Path | None = None,
    extra_env: dict[str, str] | None = None,
    job_id: str | None = None,
) -> EngineRun:
    """Launch the engine with `nproc` ranks under torchrun and wait (bounded) for it."""
    job_id = job_id or f"enginetest-{uuid.uuid4().hex[:12]}"
    run_dir = base / job_id
    run_dir.mkdir(parents=True)
    ckpt = checkpoint_dir or run_dir / "checkpoints"
    spec = copy.deepcopy(spec)
    spec["resources"]["processes_per_node"] = nproc
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DPTRAIN_FAULT_INJECT"):
        env.pop(var, None)
    # One thread per rank: 4 ranks share 2 cores, and oversubscribed OpenMP pools are far slower.
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(extra_env or {})})
    cmd = torchrun_command(
        job_id=job_id,
        nproc=nproc,
        spec_path=spec_path,
        run_dir=run_dir,
        checkpoint_dir=ckpt,
        device=spec["resources"].get("device", "cpu"),
    )
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TORCHRUN_TIMEOUT_S,
    )
    return EngineRun(job_id, run_dir, ckpt, proc.returncode, proc.stdout)


@pytest.fixture
def engine_runner(tmp_path: Path) -> Callable[..., EngineRun]:
    """`engine_runner(spec, nproc, **kw)` launches under this test's tmp_path."""

    def _run(spec: dict[str, Any], nproc: int, **kw: Any) -> EngineRun:
        return run_engine(tmp_path, spec, nproc, **kw)

    return _run


@pytest.fixture(name="make_spec")
def make_spec_fixture() -> Callable[..., dict[str, Any]]:
    """`make_spec(hyperparameters={...}, ...)`; a fixture so tests never import conftest by module name."""
    return make_spec


EQUIVALENCE_WORLDS = (1, 2, 4)


@pytest.fixture(scope="session")
def equivalence_spec() -> dict[str, Any]:
    """The job the equivalence runs train (momentum 0.9, weight decay 1e-4, global batch 32, 10 steps)."""
    return make_spec()


@pytest.fixture(scope="session")
def equivalence_runs(
    tmp_path_factory: pytest.TempPathFactory, equivalence_spec: dict[str, Any]
) -> dict[int, EngineRun]:
    """The same job at world 1, 2 and 4 (shared by the equivalence and event tests: launches are slow)."""
    base = tmp_path_factory.mktemp("equivalence")
    runs = {w: run_engine(base, equivalence_spec, w) for w in EQUIVALENCE_WORLDS}
    for w, run in runs.items():
        assert run.returncode == 0, f"world {w}: expected torchrun to exit 0\n{run.describe()}"
    return runs


@pytest.fixture(scope="module")
def module_engine_runner(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., EngineRun]:
    """Like `engine_runner`, but module-scoped so a test module can share launches between its tests."""
    base = tmp_path_factory.mktemp("module-runs")

    def _run(spec: dict[str, Any], nproc: int, **kw: Any) -> EngineRun:
        return run_engine(base, spec, nproc, **kw)

    return _run
