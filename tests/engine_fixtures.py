"""Engine launches for tests: write a spec, run the engine under torchrun, read its events and checkpoints.

`engine_runner` launches afresh for each call; `launched` runs each distinct launch once per session
and hands every test that asks for it the same finished run, so tests and modules that compare the
same reference run share one torchrun (or one spawned gloo group) instead of each paying for it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rank_contract.layout import RunFiles
from workers.attempt.launch import torchrun_command
from workers.engine.checkpoint import checkpoint_name

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_TIMEOUT_S = 120


def read_events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """The events rank `rank` of a run wrote, as the JSON objects on its lines (empty if none)."""
    path = RunFiles(run_dir).rank_events(rank)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
        return read_events(self.run_dir, rank)

    def log(self, rank: int = 0) -> str:
        """Rank `rank`'s captured stdout/stderr."""
        path = self.run_dir / "logs" / f"rank{rank}.log"
        return path.read_text() if path.exists() else ""

    def checkpoint(self, step: int) -> dict[str, Any]:
        """The checkpoint for `step`, loaded the only allowed way."""
        import torch

        path = self.checkpoint_dir / checkpoint_name(step)
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
    """`engine_runner(spec, nproc, **kw)` launches afresh under this test's tmp_path.

    For runs a test alters or that must fail: a resume from a copied checkpoint directory, an
    injected fault, a job that is meant to diverge.
    """

    def _run(spec: dict[str, Any], nproc: int, **kw: Any) -> EngineRun:
        return run_engine(tmp_path, spec, nproc, **kw)

    return _run


class Launches:
    """Launches run once per session, keyed by everything that makes one launch differ from another.

    What it hands out is shared: read its runs and results, never write into their directories
    (copy a checkpoint out first, as the resume tests do).
    """

    def __init__(self, base: Path) -> None:
        self.base = base
        self._runs: dict[str, EngineRun] = {}
        self._gloo: dict[tuple[str, str, int], list[Any] | Exception] = {}

    def torchrun(
        self, spec: dict[str, Any], nproc: int, *, extra_env: dict[str, str] | None = None
    ) -> EngineRun:
        """The finished torchrun launch of `spec` on `nproc` ranks, which must succeed.

        The test's own environment is not part of the key: a launch that depends on it (a
        monkeypatched DPTRAIN_* variable) passes it as `extra_env`, or runs on `engine_runner`.
        """
        key = json.dumps(
            {
                "spec": {**spec, "resources": {**spec["resources"], "processes_per_node": nproc}},
                "nproc": nproc,
                "env": extra_env or {},
            },
            sort_keys=True,
        )
        if key not in self._runs:
            self._runs[key] = run_engine(self.base / "torchrun", spec, nproc, extra_env=extra_env)
        run = self._runs[key]
        assert run.returncode == 0, (
            f"world {nproc} {spec['engine']}: expected torchrun to exit 0\n{run.describe()}"
        )
        return run

    def gloo(self, worker: Callable[..., None], world: int) -> list[Any]:
        """What each rank of `worker(rank, world, out_dir)` saved to `out_dir/rank{r}.pt`, spawned once."""
        import torch

        from tests.engine.spawn import spawn_gloo

        key = (worker.__module__, worker.__qualname__, world)
        if key not in self._gloo:
            out = self.base / "gloo" / f"{worker.__module__}.{worker.__qualname__}.w{world}"
            out.mkdir(parents=True)
            try:
                spawn_gloo(worker, world, str(out))
                self._gloo[key] = [torch.load(out / f"rank{r}.pt") for r in range(world)]
            except Exception as exc:  # every test that asks gets this failure, none spawns again
                self._gloo[key] = exc
        result = self._gloo[key]
        if isinstance(result, Exception):
            raise result
        return result


@pytest.fixture(scope="session")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    """`launched.torchrun(spec, nproc)` and `launched.gloo(worker, world)`, each run once per session."""
    return Launches(tmp_path_factory.mktemp("launched"))


def train_in_process(spec: Any, plan: Any, run_dir: Path) -> dict[str, Any]:
    """Train `plan` under `spec` (a JobSpec) at world 1 in this process, as a rank would; its final state."""
    import torch

    from workers.engine.checkpoint import CheckpointManager
    from workers.engine.distributed import DistEnv
    from workers.engine.events import EventWriter
    from workers.engine.trainer import Trainer

    events = EventWriter(RunFiles(run_dir).rank_events(0), 0)
    checkpoints = CheckpointManager(
        run_dir / "checkpoints", spec.checkpoint.keep_last, True, spec.checkpoint.every_steps
    )
    try:
        local = spec.local_batch_size(1)
        trainer = Trainer(
            spec, plan, DistEnv(), torch.device("cpu"), events, checkpoints, local_batch_size=local
        )
        trainer.train()
        return trainer.state_dict()
    finally:
        events.close()


def processes_mentioning(text: str) -> list[str]:
    """Live processes with `text` in an argument (a job id): a rank, or a loader process it forked."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:  # process exited while we looked
            continue
        if any(text.encode() in a for a in args):
            found.append(f"{cmdline.parent.name}: {b' '.join(args).decode(errors='replace')}")
    return found


def assert_bitwise_equal(a: Any, b: Any, where: str) -> None:
    """Recursive torch.equal over checkpoint structures."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where}: expected bitwise-equal tensors"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: expected keys {sorted(a)}, got {b!r}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: expected {a!r}, got {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: expected {a!r}, got {b!r}"


def assert_no_process_left(job_id: str, *, within: float = 15) -> None:
    """Wait up to `within` seconds for every process of `job_id` (ranks, their loader processes) to go."""
    # A killed rank's loader processes notice their parent is gone within torch's 5 s status check.
    deadline = time.monotonic() + within
    while (left := processes_mentioning(job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"expected no process of job {job_id} to remain, found {left}"
