"""Event stream sanity, the event contract, config validation, sampler determinism, the launcher helper."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import ValidationError

from api_schemas.recipes import MlpParams
from rank_contract.layout import RunFiles
from workers.engine.batch_sampler import GlobalBatchSampler
from workers.engine.checkpoint import checkpoint_name
from workers.engine.config import configure
from workers.engine.events import (
    CheckpointEvent,
    ErrorEvent,
    Event,
    EventWriter,
    FinishedEvent,
    MetricsEvent,
    StartedEvent,
    WarningEvent,
    parse_event,
)
from workers.engine.faults import parse_fault
from workers.engine.recipes import RECIPES, plan_params

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
        assert set(vals) == {"loss", "lr", "samples_per_s", "step_time_s", "data_wait_s"}, (
            f"unexpected {vals}"
        )
        assert math.isfinite(vals["loss"]) and vals["samples_per_s"] > 0 and vals["step_time_s"] > 0, vals
        # The time waited for batches is part of the step's time.
        assert 0 <= vals["data_wait_s"] <= vals["step_time_s"], vals
    ckpts = [e for e in events if e["type"] == "checkpoint"]
    assert [c["step"] for c in ckpts] == [steps], f"expected only the last-step checkpoint, got {ckpts}"
    assert "path" not in ckpts[0], "a checkpoint event names a step, never a path"
    data = (run.checkpoint_dir / checkpoint_name(steps)).read_bytes()
    assert ckpts[0]["sha256"] == hashlib.sha256(data).hexdigest(), "event sha256 differs from the file's"
    assert ckpts[0]["size_bytes"] == len(data) and ckpts[0]["deleted"] == []
    assert events[-1]["step"] == steps, f"expected finished at step {steps}, got {events[-1]}"
    for rank in range(1, world):
        assert run.events(rank) == [], (
            f"rank {rank} should write no events on success, got {run.events(rank)}"
        )
        assert f"rank {rank} done" in run.log(rank), f"expected rank {rank}'s log to be captured"


def test_the_engine_reads_spec_json_into_the_api_model(make_spec: Any) -> None:
    text = json.dumps(make_spec(hyperparameters={"global_batch_size": 30, "hidden_size": 8}))
    config = configure(text, 2)
    assert plan_params(config.spec) == {**MlpParams().model_dump(), "hidden_size": 8}
    assert config.local_batch_size == 15
    with pytest.raises(ValueError, match="not divisible by the world size 4"):
        configure(text, 4)
    with pytest.raises(ValidationError, match="lr"):
        configure(json.dumps(make_spec(hyperparameters={"lr": 0})), 1)
    with pytest.raises(ValidationError, match="bucket_cap\n  Extra inputs are not permitted"):
        configure(json.dumps(make_spec(engine={"bucket_cap": 1})), 1)
    with pytest.raises(ValidationError, match="depth\n  Extra inputs are not permitted"):
        RECIPES["mlp"]({"depth": 3}, 0)


def test_sampler_is_a_pure_function_of_iter() -> None:
    a, b = GlobalBatchSampler(10, 4, seed=5), GlobalBatchSampler(10, 4, seed=5)
    stream = [int(i) for it in range(5) for i in a.global_indices(it)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10)), stream
    assert b.global_indices(3).tolist() == a.global_indices(3).tolist(), "expected no hidden sampler state"
    for world in (1, 2, 4):
        parts = [a.local_indices(2, r, 4 // world).tolist() for r in range(world)]
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
        "import sys; from workers.attempt.launch import torchrun_command as t; "
        "assert 'torch' not in sys.modules; "
        "print(t(job_id='j', nproc=2, spec_path='s', run_dir='r', checkpoint_dir='c'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"expected a torch-free import, got {out.stderr}"
    assert "'--nproc-per-node=2', '--start-method=fork', '--run-path'" in out.stdout, out.stdout


# ---- the event contract: what ranks write is what the runner reads --------------------------------


def _one_of_each(writer: EventWriter) -> list[Event]:
    """One event of every kind, as the engine emits them (the error from a real exception)."""
    events: list[Event] = [
        StartedEvent(world_size=2, start_iter=4, total_steps=10, device="cpu", backend="gloo"),
        MetricsEvent(step=5, values={"loss": 0.5, "lr": 0.1, "grad_norm": math.inf, "odd": math.nan}),
        CheckpointEvent(step=6, size_bytes=9, sha256="a" * 64, deleted=[4]),
        FinishedEvent(step=10),
        WarningEvent(rank=1, message="rank 1 was killed by SIGABRT after dptrain.finish()"),
    ]
    writer.emit(events[0])
    writer.emit_many(events[1:])
    try:
        raise KeyError("boom")
    except KeyError as exc:
        events.append(writer.error(exc))
    return events


def test_every_event_kind_round_trips_through_its_line(tmp_path: Path) -> None:
    writer = EventWriter(RunFiles(tmp_path).rank_events(1), 1)
    written = _one_of_each(writer)
    writer.close()
    kinds = {get_args(cls.model_fields["type"].annotation)[0] for cls in get_args(get_args(Event)[0])}
    assert {e.type for e in written} == kinds, "the sample must hold every kind of event"
    lines = RunFiles(tmp_path).rank_events(1).read_text().splitlines()
    read = [parse_event(line) for line in lines]
    # NaN != NaN: compare the lines' JSON text for the metrics, the models for the rest.
    assert [e.model_dump_json() for e in read] == [e.model_dump_json() for e in written], lines
    assert [type(e) for e in read] == [type(e) for e in written]
    error = read[-1]
    assert isinstance(error, ErrorEvent) and (error.rank, error.error_type) == (1, "KeyError"), error
    assert error.traceback is not None and 'raise KeyError("boom")' in error.traceback, error.traceback


def test_lines_keep_the_keys_of_the_json_format() -> None:
    # What older runners and tools (jq, the tests' own readers) expect on disk: type first, same keys.
    line = MetricsEvent(time=1.5, step=3, values={"loss": 1.0}).model_dump_json()
    assert json.loads(line) == {"type": "metrics", "time": 1.5, "step": 3, "values": {"loss": 1.0}}, line
    assert list(json.loads(line))[0] == "type", line
    older = '{"type": "finished", "time": 2.0, "step": 7, "extra": "ignored"}'
    assert parse_event(older) == FinishedEvent(time=2.0, step=7), "a line with an unknown key still reads"


@pytest.mark.parametrize(
    "line",
    [
        '{"type": "metrics", "time": 1.0, "step": 3, "values": {"loss"',  # cut short by a crash
        "not json",
        '{"type": "teleported", "time": 1.0}',
        '{"type": "metrics", "time": 1.0, "values": {}}',
        '{"type": "checkpoint", "time": 1.0, "step": "six", "path": "p", "size_bytes": 1, "sha256": "s"}',
        '["metrics"]',
    ],
    ids=["truncated", "not-json", "unknown-type", "missing-step", "bad-step", "not-an-object"],
)
def test_a_bad_line_is_refused(line: str) -> None:
    with pytest.raises(ValidationError):
        parse_event(line)
