"""The engine's `init_from` start, in-process at world 1: resume is exact, own checkpoints win, a
checkpoint of another model is refused as a ValueError (not retried), naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from api_schemas import JobSpec
from rank_contract.env import INIT_CHECKPOINT_ENV
from rank_contract.layout import RunFiles
from tests.engine_fixtures import assert_bitwise_equal
from workers.engine.checkpoint import checkpoint_name
from workers.engine.events import StartedEvent, parse_event
from workers.engine.main import main

SOURCE = "a" * 32


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", INIT_CHECKPOINT_ENV):
        monkeypatch.delenv(var, raising=False)


def _run(make_spec: Any, tmp_path: Path, name: str, ckpt: Path, **over: Any) -> list[int]:
    """Run the engine in this process on `ckpt`; the start ITERs its rank 0 reported."""
    spec = JobSpec.model_validate(make_spec(**over))
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(json.dumps(spec.model_dump(mode="json")))
    argv = ["--job-id", name, "--spec", str(run_dir / "spec.json"), "--run-dir", str(run_dir)]
    main([*argv, "--checkpoint-dir", str(ckpt)])
    lines = RunFiles(run_dir).rank_events(0).read_text().splitlines()
    return [e.start_iter for e in map(parse_event, lines) if isinstance(e, StartedEvent)]


def _load(path: Path) -> dict[str, Any]:
    return dict(torch.load(path, weights_only=True))


def test_resume_continues_exactly_and_the_jobs_own_checkpoints_win(
    make_spec: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    every = {"checkpoint": {"every_steps": 4, "keep_last": 5}, "hyperparameters": {"steps": 8}}
    source = tmp_path / "source-ckpt"
    assert _run(make_spec, tmp_path, "source", source, **every) == [0]

    monkeypatch.setenv(INIT_CHECKPOINT_ENV, str(source / checkpoint_name(4)))
    mine = tmp_path / "continued-ckpt"
    resumed = {**every, "init_from": {"job": SOURCE, "resume": True}}
    assert _run(make_spec, tmp_path, "continued", mine, **resumed) == [4]
    want, got = _load(source / checkpoint_name(8)), _load(mine / checkpoint_name(8))
    for key in ("model", "optimizer", "iter", "rng"):
        assert_bitwise_equal(want[key], got[key], key)

    # A later run of the job (a restart) starts from its own newest checkpoint, not from init_from's.
    longer = {**resumed, "hyperparameters": {"steps": 12}}
    assert _run(make_spec, tmp_path, "restarted", mine, **longer) == [8]


def test_a_checkpoint_of_another_model_is_a_value_error_naming_it(
    make_spec: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "source-ckpt"
    _run(make_spec, tmp_path, "source", source, hyperparameters={"steps": 2, "hidden_size": 8})
    monkeypatch.setenv(INIT_CHECKPOINT_ENV, str(source / checkpoint_name(2)))
    other = {"hyperparameters": {"steps": 2, "hidden_size": 16}, "init_from": {"job": SOURCE}}
    with pytest.raises(ValueError, match=r"init_from: ckpt-000000002\.pt does not fit this job's plan"):
        _run(make_spec, tmp_path, "tune", tmp_path / "tune-ckpt", **other)
