"""The SDK in-process: a no-op outside dptrain; inside, events the runner reads and verified checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import dptrain
from rank_contract.env import INIT_CHECKPOINT_ENV, RUN_DIR_ENV, sdk_env
from rank_contract.layout import RunFiles
from workers.engine.checkpoint import CheckpointManager, checkpoint_files, sha256_file
from workers.engine.events import CheckpointEvent, Event, MetricsEvent, parse_event


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An active SDK as rank 0 of a run in tmp_path/run, checkpoints in tmp_path/ckpt, keep_last 2."""
    env = sdk_env(
        job_id="job-1",
        attempt=1,
        run_dir=tmp_path / "run",
        checkpoint_dir=tmp_path / "ckpt",
        keep_last=2,
        supervisor="",
    )
    for name, value in {**env, "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    return tmp_path / "run"


def _events(run_dir: Path, rank: int = 0) -> list[Event]:
    path = RunFiles(run_dir).rank_events(rank)
    return [parse_event(line) for line in path.read_text().splitlines()] if path.exists() else []


def _state(step: int) -> dict[str, object]:
    return {"model": {"w": torch.full((3,), float(step))}, "step": step, "note": f"step {step}"}


def test_every_call_is_a_no_op_outside_dptrain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    monkeypatch.setenv("DPTRAIN_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stop").touch()
    assert not dptrain.is_active()
    dptrain.report(1, loss=1.0, bad="not checked either")  # type: ignore[arg-type]
    assert dptrain.save_checkpoint(_state(1), 1) is None
    assert dptrain.load_checkpoint() is None
    assert dptrain.should_stop() is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stop"], "nothing may be written"


def test_report_writes_a_metrics_event_the_runner_reads(run_dir: Path) -> None:
    assert dptrain.is_active()
    dptrain.report(3, loss=torch.tensor(0.25), lr=np.float32(0.5), tokens=128)
    dptrain.report(np.int64(4), loss=0.125)
    events = _events(run_dir)
    assert [type(e) for e in events] == [MetricsEvent, MetricsEvent]
    first, second = events
    assert isinstance(first, MetricsEvent) and isinstance(second, MetricsEvent)
    assert (first.step, first.values) == (3, {"loss": 0.25, "lr": 0.5, "tokens": 128.0})
    assert (second.step, second.values) == (4, {"loss": 0.125})


@pytest.mark.parametrize("value", [True, "0.5", torch.tensor([1.0, 2.0]), np.bool_(False), None], ids=repr)
def test_report_refuses_a_metric_that_is_no_number(run_dir: Path, value: object) -> None:
    with pytest.raises(TypeError, match="metric 'loss' must be a number"):
        dptrain.report(1, loss=value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be an int"):
        dptrain.report(True, loss=1.0)
    assert _events(run_dir) == []


def test_save_checkpoint_writes_verified_checkpoints_and_keeps_the_last(
    run_dir: Path, tmp_path: Path
) -> None:
    paths = [dptrain.save_checkpoint(_state(step), step) for step in (2, 4, 6)]
    ckpt = tmp_path / "ckpt"
    assert paths == [str(ckpt / f"ckpt-00000000{s}.pt") for s in (2, 4, 6)]
    assert list(checkpoint_files(ckpt)) == [4, 6], "keep_last=2 prunes the oldest"
    events = [e for e in _events(run_dir) if isinstance(e, CheckpointEvent)]
    assert [(e.step, e.deleted) for e in events] == [(2, []), (4, []), (6, [2])]
    digest, size = sha256_file(ckpt / "ckpt-000000006.pt")
    assert (events[-1].sha256, events[-1].size_bytes) == (digest, size)
    assert (ckpt / "ckpt-000000006.pt.sha256").read_text().split()[0] == digest


def test_load_checkpoint_returns_the_newest_that_verifies(run_dir: Path, tmp_path: Path) -> None:
    assert dptrain.load_checkpoint() is None, "no checkpoint yet"
    for step in (2, 4):
        dptrain.save_checkpoint(_state(step), step)
    state = dptrain.load_checkpoint()
    assert state is not None and state["step"] == 4 and state["note"] == "step 4"
    assert torch.equal(state["model"]["w"], torch.full((3,), 4.0))
    newest = tmp_path / "ckpt" / "ckpt-000000004.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    fallback = dptrain.load_checkpoint()
    assert fallback is not None and fallback["step"] == 2, "a corrupted newest falls back to the older one"


def test_the_engine_still_loads_only_training_states(run_dir: Path, tmp_path: Path) -> None:
    dptrain.save_checkpoint(_state(2), 2)
    with pytest.raises(ValueError, match="not a training checkpoint"):
        CheckpointManager(tmp_path / "ckpt", 3, is_main=False).read(2)


def test_should_stop_follows_the_stop_file(run_dir: Path) -> None:
    assert dptrain.should_stop() is False
    run_dir.mkdir(parents=True)
    RunFiles(run_dir).stop.touch()
    assert dptrain.should_stop() is True
    os.remove(RunFiles(run_dir).stop)
    assert dptrain.should_stop() is False


def test_other_ranks_write_nothing_but_load(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dptrain.save_checkpoint(_state(2), 2)  # as rank 0
    monkeypatch.setenv("RANK", "1")
    dptrain.report(3, loss=1.0)
    assert dptrain.save_checkpoint(_state(4), 4) is None
    assert list(checkpoint_files(tmp_path / "ckpt")) == [2]
    assert not RunFiles(run_dir).rank_events(1).exists()
    assert [e.type for e in _events(run_dir)] == ["checkpoint"]
    state = dptrain.load_checkpoint()
    assert state is not None and state["step"] == 2


def test_output_dir_is_the_jobs_under_dptrain_and_the_default_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DPTRAIN_OUTPUT_DIR", raising=False)
    assert dptrain.output_dir() == Path("out")
    assert dptrain.output_dir(tmp_path / "mine") == tmp_path / "mine"
    env = sdk_env(
        job_id="job-1",
        attempt=1,
        run_dir=tmp_path / "run",
        checkpoint_dir=tmp_path / "ckpt",
        keep_last=2,
        supervisor=None,
        output_dir=tmp_path / "outputs",
    )
    monkeypatch.setenv("DPTRAIN_OUTPUT_DIR", env["DPTRAIN_OUTPUT_DIR"])
    assert dptrain.output_dir("ignored") == tmp_path / "outputs"


def test_load_checkpoint_gives_the_init_from_one_until_the_job_has_its_own(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The init file as the worker hands it over: another job's checkpoint, pinned with its sidecars.
    source = CheckpointManager(tmp_path / "init", 1, is_main=True, training_state=False)
    saved = source.save(20, _state(20))
    assert saved is not None
    monkeypatch.setenv(INIT_CHECKPOINT_ENV, str(saved.path))
    state = dptrain.load_checkpoint()
    assert state is not None and state["step"] == 20, "no checkpoint of its own: the init_from one"
    dptrain.save_checkpoint(_state(21), 21)
    own = dptrain.load_checkpoint()
    assert own is not None and own["step"] == 21, "its own checkpoints win"
    for name in os.listdir(tmp_path / "ckpt"):
        os.remove(tmp_path / "ckpt" / name)
    data = bytearray(saved.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    saved.path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="xxh128"):
        dptrain.load_checkpoint()
