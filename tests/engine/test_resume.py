"""Resume from a checkpoint is bitwise exact; the checkpoint manager is atomic, retained and falls back."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine_fixtures import Launches, assert_bitwise_equal
from workers.engine.checkpoint import CheckpointManager, checkpoint_name
from workers.engine.main import main


@pytest.mark.e2e
def test_resume_is_bitwise_exact(
    launched: Launches, engine_runner: Any, make_spec: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    spec = make_spec(hyperparameters={"steps": 8}, checkpoint={"every_steps": 4, "keep_last": 3})
    full = launched.torchrun(spec, 2)  # tests/engine/test_elastic.py resumes from it too
    assert full.returncode == 0, f"uninterrupted run: expected rc 0\n{full.describe()}"
    ckpts = [e["step"] for e in full.events(0) if e["type"] == "checkpoint"]
    assert ckpts == [4, 8], f"expected checkpoints at steps [4, 8], got {ckpts}"

    fresh = tmp_path / "resumed-ckpts"
    fresh.mkdir()
    src = full.checkpoint_dir / checkpoint_name(4)
    for path in (src, CheckpointManager.sidecar_for(src)):
        shutil.copy(path, fresh / path.name)
    resumed = engine_runner(spec, 2, checkpoint_dir=fresh)
    assert resumed.returncode == 0, f"resumed run: expected rc 0\n{resumed.describe()}"
    started = [e for e in resumed.events(0) if e["type"] == "started"]
    assert [e["start_iter"] for e in started] == [4], f"expected one start at iter 4, got {started}"

    want, got = full.checkpoint(8), resumed.checkpoint(8)
    assert got["iter"] == 8, f"expected iter 8, got {got['iter']}"
    for key in ("model", "optimizer", "iter", "world_size"):
        assert_bitwise_equal(want[key], got[key], key)

    # Elastic: the world-2 checkpoint also resumes at world 1 (in-process, no torchrun) to the same
    # result up to float reassociation, and a finished job re-run is a no-op that exits cleanly.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    elastic = tmp_path / "elastic-ckpts"
    elastic.mkdir()
    shutil.copy(src, elastic)
    spec_path = full.run_dir / "spec.json"
    argv = ["--job-id", "elastic", "--spec", str(spec_path), "--run-dir", str(tmp_path / "elastic-run")]
    main([*argv, "--checkpoint-dir", str(elastic)])
    one = torch.load(elastic / checkpoint_name(8), weights_only=True, map_location="cpu")
    assert one["world_size"] == 1 and one["iter"] == 8, f"expected world 1 iter 8, got {one['world_size']}"
    for name, t in want["model"].items():
        diff = (one["model"][name] - t).abs().max().item()
        assert diff <= 1e-6, f"world 2->1 resume: expected |{name} diff| <= 1e-6, got {diff:.3g}"
    before = sorted(p.name for p in elastic.iterdir())
    main([*argv, "--checkpoint-dir", str(elastic)])
    assert sorted(p.name for p in elastic.iterdir()) == before, (
        "expected a finished job's re-run to write nothing"
    )


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((4,), float(step))}, "iter": step, "optimizer": {"state": {}}}


def test_checkpoint_manager_atomic_retention_and_fallback(tmp_path: Path, monkeypatch: Any) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2, is_main=True, every_steps=2)
    assert mgr.load() is None, "expected no checkpoint in an empty directory"
    assert mgr.save(3, _state(3)) is None, "expected no save off the every_steps cadence"
    deleted: list[Path] = []
    for step in (2, 4, 6):
        saved = mgr.save(step, _state(step))
        assert saved is not None
        digest = hashlib.sha256(saved.path.read_bytes()).hexdigest()
        assert (saved.sha256, saved.size_bytes) == (digest, saved.path.stat().st_size), "sha256/size mismatch"
        deleted += saved.deleted
    assert mgr.save(7, _state(7), last=True) is not None, "expected the last step to be saved off-cadence"
    assert mgr.steps() == [6, 7], f"expected keep_last=2 to leave [6, 7], got {mgr.steps()}"
    assert deleted == [mgr.path_for(2)], f"unexpected deletions {deleted}"
    names = sorted(p.name for p in tmp_path.iterdir())
    kept = [mgr.path_for(6), mgr.path_for(7)]
    assert names == sorted(p.name for c in kept for p in (c, *CheckpointManager.sidecars(c))), names

    # A writer dying mid-save leaves no checkpoint and no temp file behind, and the old ones intact.
    def boom(*_: Any, **__: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        mgr.save(8, _state(8))
    monkeypatch.undo()
    assert mgr.steps() == [6, 7] and not list(tmp_path.glob(".*")), f"left behind: {list(tmp_path.iterdir())}"

    # Only rank 0 writes.
    assert CheckpointManager(tmp_path, 2, is_main=False).save(10, _state(10)) is None
    assert mgr.steps() == [6, 7]

    # A corrupt newest checkpoint (checksum mismatch, then also no sidecar) falls back to the previous one.
    newest = mgr.path_for(7)
    newest.write_bytes(newest.read_bytes()[:100])
    loaded = mgr.load()
    assert loaded is not None and loaded.step == 6 and loaded.state["iter"] == 6, "expected fallback to 6"
    mgr.sidecar_for(newest).unlink()
    loaded = mgr.load()
    assert loaded is not None and loaded.step == 6, (
        "expected a truncated file without sidecar to be skipped too"
    )
    mgr.path_for(6).write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match="no loadable checkpoint"):
        mgr.load()
