"""Elastic resume: a checkpoint written by N ranks resumes on M ranks with the same math.

The global batch of step `it` is a pure function of (seed, it), so the sampler position is ITER
itself; the checkpoint holds the full, unsharded model and optimizer state, so any world size can
load it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine_fixtures import Launches
from workers.engine.checkpoint import CheckpointManager, checkpoint_name

pytestmark = pytest.mark.e2e  # torchrun at world 4, 2 and 1

TOL = 1e-6


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"expected the same tensors, got {sorted(a)} vs {sorted(b)}"
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _momentum(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {str(k): v["momentum_buffer"] for k, v in ckpt["optimizer"]["state"].items()}


def _copy_checkpoint(src: Path, step: int, dst: Path) -> Path:
    dst.mkdir()
    ckpt = src / checkpoint_name(step)
    for path in (ckpt, CheckpointManager.sidecar_for(ckpt)):
        shutil.copy(path, dst / path.name)
    return dst


def test_resume_on_another_world_size_equals_the_uninterrupted_run(
    launched: Launches, engine_runner: Any, make_spec: Any, tmp_path: Path
) -> None:
    spec = make_spec(hyperparameters={"steps": 8}, checkpoint={"every_steps": 4, "keep_last": 3})
    full = launched.torchrun(spec, 2)  # the same run as tests/engine/test_resume.py's
    assert full.returncode == 0, f"uninterrupted world 2: expected rc 0\n{full.describe()}"
    want = full.checkpoint(8)

    # 4 -> 2: four ranks train the first half, two ranks finish it.
    first_half = make_spec(hyperparameters={"steps": 4}, checkpoint={"every_steps": 4, "keep_last": 3})
    four = engine_runner(first_half, 4)
    assert four.returncode == 0, f"world 4, steps 0-4: expected rc 0\n{four.describe()}"
    assert four.checkpoint(4)["world_size"] == 4
    to_two = engine_runner(
        spec, 2, checkpoint_dir=_copy_checkpoint(four.checkpoint_dir, 4, tmp_path / "4to2")
    )
    assert to_two.returncode == 0, f"4 -> 2 resume: expected rc 0\n{to_two.describe()}"
    assert [e["start_iter"] for e in to_two.events(0) if e["type"] == "started"] == [4]

    # 2 -> 1: the uninterrupted run's own step-4 checkpoint, finished by one rank.
    to_one = engine_runner(
        spec, 1, checkpoint_dir=_copy_checkpoint(full.checkpoint_dir, 4, tmp_path / "2to1")
    )
    assert to_one.returncode == 0, f"2 -> 1 resume: expected rc 0\n{to_one.describe()}"

    for name, run in (("4 -> 2", to_two), ("2 -> 1", to_one)):
        got = run.checkpoint(8)
        assert got["iter"] == 8, f"{name}: expected iter 8, got {got['iter']}"
        params = _max_diff(want["model"], got["model"])
        assert params <= TOL, (
            f"{name}: parameters differ by {params:.3e} from the uninterrupted run (allowed {TOL})"
        )
        momentum = _max_diff(_momentum(want), _momentum(got))
        assert momentum <= TOL, f"{name}: momentum buffers differ by {momentum:.3e} (allowed {TOL})"
