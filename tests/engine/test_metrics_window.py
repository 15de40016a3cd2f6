"""Batched metrics: window lengths, flush points, the batched write, and the logged loss at world 2."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from api_schemas import JobSpec
from tests.engine.spawn import spawn_gloo
from workers.engine import distributed
from workers.engine import metrics_window as mw
from workers.engine.checkpoint import CheckpointManager
from workers.engine.events import EventWriter, MetricsEvent, StartedEvent, parse_event
from workers.engine.faults import Fault
from workers.engine.metrics_window import MAX_WINDOW, TARGET_SECONDS, MetricsWindow, next_window
from workers.engine.recipes import RECIPES, plan_params
from workers.engine.trainer import Trainer
from workers.reporting.tail import Tail


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_next_window_is_target_seconds_of_steps_within_bounds() -> None:
    assert next_window(TARGET_SECONDS / 10) == 10
    assert next_window(TARGET_SECONDS / 10.5) == 10, "expected the floor"
    assert next_window(TARGET_SECONDS * 3) == 1, "a slow step still gets a window of one"
    assert next_window(1e-9) == MAX_WINDOW
    assert next_window(1e-320) == MAX_WINDOW, "a denormal step time must not overflow"
    assert next_window(0.0) == MAX_WINDOW and next_window(math.nan) == MAX_WINDOW


class FakeClock:
    """perf_counter and time.time for metrics_window, advanced by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now + 1e9


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(mw, "time", c)
    return c


def _run(
    tmp_path: Path,
    clock: FakeClock,
    *,
    steps: int,
    step_time: float,
    log_every: int = 1,
    saves: tuple[int, ...] = (),
    save_time: float = 0.0,
) -> tuple[list[int], list[dict[str, Any]]]:
    """Drive a world-1 window as Trainer.train() does; (flush steps, metrics events)."""
    events = EventWriter(tmp_path / "rank0.jsonl", 0)
    w = MetricsWindow(
        env=distributed.DistEnv(),
        device=torch.device("cpu"),
        events=events,
        global_batch_size=32,
        log_every=log_every,
        total_steps=steps,
        start_step=0,
    )
    flushes = []
    for step in range(1, steps + 1):
        clock.now += step_time
        last, save = step == steps, step in saves
        if w.logs(step):
            w.record(step, loss=torch.tensor(float(step)), lr=0.1, grad_norm=torch.tensor(2.0 * step))
        if w.due(step, force=last or save):
            flushes.append(step)
            w.flush(step)
        if save:
            clock.now += save_time
            w.restart_clock(step)
    events.close()
    return flushes, [e for e in _events(tmp_path / "rank0.jsonl") if e["type"] == "metrics"]


def test_first_window_is_one_step_then_adapts_to_the_step_time(tmp_path: Path, clock: FakeClock) -> None:
    # Step times are powers of two here, so the fake clock's sums are exact.
    flushes, metrics = _run(tmp_path, clock, steps=30, step_time=TARGET_SECONDS / 4)
    # Step 1 alone, then windows of 4 steps (TARGET_SECONDS of quarter-target steps), the last forced.
    assert flushes == [1, 5, 9, 13, 17, 21, 25, 29, 30], flushes
    assert [e["step"] for e in metrics] == list(range(1, 31)), "one event per step, in step order"
    for e in metrics:
        v = e["values"]
        assert v["loss"] == float(e["step"]) and v["lr"] == 0.1 and v["grad_norm"] == 2.0 * e["step"], v
        assert v["step_time_s"] == pytest.approx(TARGET_SECONDS / 4), v
        assert v["samples_per_s"] == pytest.approx(32 / (TARGET_SECONDS / 4)), v
        assert e["time"] == pytest.approx(1e9 + 1000.0 + e["step"] * TARGET_SECONDS / 4), (
            "an event's time is when its step ended, not when its window was written"
        )


def test_saves_and_the_last_step_force_a_flush_and_save_time_is_not_step_time(
    tmp_path: Path, clock: FakeClock
) -> None:
    flushes, metrics = _run(
        tmp_path, clock, steps=40, step_time=TARGET_SECONDS / 8, saves=(4, 20), save_time=5.0
    )
    # 1 (first window), 4 (save), 12 and 20 (save) and 28, 36 (windows of 8), 40 (last).
    assert flushes == [1, 4, 12, 20, 28, 36, 40], flushes
    assert [e["step"] for e in metrics] == list(range(1, 41))
    times = [e["values"]["step_time_s"] for e in metrics]
    assert times == pytest.approx([TARGET_SECONDS / 8] * 40), "save time leaked into step timing"


def test_slow_steps_flush_every_step(tmp_path: Path, clock: FakeClock) -> None:
    flushes, _ = _run(tmp_path, clock, steps=5, step_time=TARGET_SECONDS * 2)
    assert flushes == [1, 2, 3, 4, 5], flushes


def test_fast_steps_hold_at_most_max_window(tmp_path: Path, clock: FakeClock) -> None:
    flushes, metrics = _run(tmp_path, clock, steps=200, step_time=1e-6)
    assert flushes == [1, 1 + MAX_WINDOW, 1 + 2 * MAX_WINDOW, 1 + 3 * MAX_WINDOW, 200], flushes
    assert len(metrics) == 200


def test_log_every_counts_steps_not_logged_steps(tmp_path: Path, clock: FakeClock) -> None:
    # Steps of TARGET/16 make 16-step windows: with log_every 5 a window still closes 16 steps after the
    # last flush (at a step that is not logged, holding the logged steps since then).
    flushes, metrics = _run(tmp_path, clock, steps=50, step_time=TARGET_SECONDS / 16, log_every=5)
    assert flushes == [5, 21, 37, 50], flushes
    assert [e["step"] for e in metrics] == list(range(5, 51, 5))
    for e in metrics:
        # Per logged step: the time since the previous logged step over the steps since then.
        assert e["values"]["step_time_s"] == pytest.approx(TARGET_SECONDS / 16), e
        assert e["values"]["samples_per_s"] == pytest.approx(32 * 16 / TARGET_SECONDS), e


def test_no_flush_without_logged_steps(tmp_path: Path, clock: FakeClock) -> None:
    # A save at a step that is not logged, with nothing held, issues no collective and writes nothing.
    flushes, metrics = _run(tmp_path, clock, steps=20, step_time=0.01, log_every=10, saves=(3,))
    assert flushes == [10, 20] and [e["step"] for e in metrics] == [10, 20], (flushes, metrics)


class CountingFile(io.StringIO):
    """A text file that counts write and flush calls."""

    writes = 0
    flushes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)

    def flush(self) -> None:
        self.flushes += 1


def test_emit_many_is_one_write_of_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "events" / "rank0.jsonl"
    writer = EventWriter(path, 0)
    writer.emit(StartedEvent(world_size=1, total_steps=2, device="cpu", backend="none"))
    real = writer._f
    counting = CountingFile()
    writer._f = counting
    batch = [MetricsEvent(time=5.0, step=1, values={"loss": 1.0}), MetricsEvent(step=2, values={})]
    writer.emit_many(batch)
    assert counting.writes == 1 and counting.flushes == 1, (counting.writes, counting.flushes)
    writer.emit_many([])
    assert counting.writes == 1, "nothing to write: no write"
    lines = counting.getvalue().splitlines()
    assert [parse_event(x) for x in lines] == batch and len(lines) == 2
    assert list(json.loads(lines[0])) == ["type", "time", "step", "values"] and batch[0].time == 5.0
    assert isinstance(batch[1].time, float), "an event without a time gets the time it was made"
    # The same batch through the real file, read the way the launcher tails it.
    writer._f = real
    tail = Tail(path)
    assert len(tail.read_lines()) == 1
    writer.emit_many([MetricsEvent(step=s, values={}) for s in (1, 2, 3)])
    writer.close()
    assert [json.loads(x)["step"] for x in tail.read_lines()] == [1, 2, 3]


# ---- two Gloo ranks running the real Trainer -----------------------------------------------------

STEPS, SAVE_EVERY = 30, 12


def _trainer_worker(rank: int, world: int, out_dir: str) -> None:
    spec = {
        "name": "metrics-window",
        "recipe": "mlp",
        "hyperparameters": {"global_batch_size": 16, "lr": 0.05, "momentum": 0.9, "steps": STEPS, "seed": 7},
        "resources": {"device": "cpu"},
        "engine": {"log_every_steps": 1, "grad_clip_norm": 10.0},
        "checkpoint": {"every_steps": SAVE_EVERY, "keep_last": 2},
    }
    cfg = JobSpec.model_validate(spec)
    torch.manual_seed(7)
    plan = RECIPES["mlp"](plan_params(cfg), 7)
    local: list[torch.Tensor] = []
    loss_fn = plan.loss_fn

    def recording_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(out, target)
        local.append(loss.detach().float().clone())
        return loss

    plan = dataclasses.replace(plan, loss_fn=recording_loss)
    flushes: list[tuple[int, int]] = []
    flush = MetricsWindow.flush

    def recording_flush(self: MetricsWindow, step: int) -> None:
        flush(self, step)
        flushes.append((step, self.window))

    MetricsWindow.flush = recording_flush  # type: ignore[method-assign]  # this spawned process only
    out = Path(out_dir)
    events = EventWriter(out / f"rank{rank}.jsonl", rank)
    ckpt = CheckpointManager(out / "ckpt", 2, rank == 0, SAVE_EVERY)
    env = distributed.DistEnv(rank=rank, world_size=world, launched=True)
    # Rank 0 alone sleeps, so the ranks' clocks differ: the windows must still agree.
    fault = Fault(action="sleep", rank=0, ms=40)
    batch = cfg.local_batch_size(world)
    trainer = Trainer(
        cfg, plan, env, torch.device("cpu"), events, ckpt, local_batch_size=batch, fault=fault, backend="gloo"
    )
    trainer.train()
    events.close()
    # The logged loss as it was computed before windows: one scalar allreduce per step, sum then divide.
    reference = []
    for x in local:
        t = x.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= world
        reference.append(float(t.item()))
    torch.save({"flushes": flushes, "reference": reference, "local": local}, out / f"rank{rank}.pt")


@pytest.mark.e2e
def test_world2_logs_each_steps_global_mean_with_windows_agreed_by_all_ranks(tmp_path: Path) -> None:
    spawn_gloo(_trainer_worker, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["flushes"] == r1["flushes"], "ranks disagreed on where windows end (collectives would cross)"
    steps = [s for s, _ in r0["flushes"]]
    assert steps[0] == 1, f"the first step must be reported at once, flushes {steps}"
    assert {SAVE_EVERY, 2 * SAVE_EVERY, STEPS} <= set(steps), f"expected flushes before saves, got {steps}"
    assert len(steps) < STEPS, f"expected some window of several steps, flushes {steps}"
    assert set(steps) - {1, SAVE_EVERY, 2 * SAVE_EVERY, STEPS}, f"expected adaptive flushes, got {steps}"
    events = _events(tmp_path / "rank0.jsonl")
    metrics = [e for e in events if e["type"] == "metrics"]
    assert [e["step"] for e in metrics] == list(range(1, STEPS + 1))
    losses = [e["values"]["loss"] for e in metrics]
    assert losses == r0["reference"], "expected bitwise the per-step allreduce's global mean"
    local_mean = [(float(a) + float(b)) / 2 for a, b in zip(r0["local"], r1["local"], strict=True)]
    assert losses == pytest.approx(local_mean, rel=1e-6), "expected the mean of the two ranks' losses"
    assert all("grad_norm" in e["values"] and e["values"]["step_time_s"] > 0 for e in metrics)
    order = [(e["type"], e.get("step")) for e in events if e["type"] in ("metrics", "checkpoint")]
    for save in (SAVE_EVERY, 2 * SAVE_EVERY, STEPS):
        at = order.index(("checkpoint", save))
        assert order[at - 1] == ("metrics", save), f"checkpoint {save} must follow its step's metrics"
    assert _events(tmp_path / "rank1.jsonl") == [], "rank 1 writes no events on success"


@pytest.mark.e2e
def test_torchrun_world2_reports_every_step_like_world1(engine_runner: Any, make_spec: Any) -> None:
    spec = make_spec(
        hyperparameters={"steps": 12},
        engine={"log_every_steps": 1},
        checkpoint={"every_steps": 5, "keep_last": 5},
    )
    runs = {w: engine_runner(spec, w) for w in (1, 2)}
    by_world = {}
    for w, run in runs.items():
        assert run.returncode == 0, f"world {w}: expected rc 0\n{run.describe()}"
        kinds = [(e["type"], e.get("step")) for e in run.events(0)]
        want = [("started", None)]
        for step in range(1, 13):
            want.append(("metrics", step))
            if step in (5, 10, 12):
                want.append(("checkpoint", step))
        assert kinds == [*want, ("finished", 12)], f"world {w}: events out of order: {kinds}"
        by_world[w] = [e["values"]["loss"] for e in run.events(0) if e["type"] == "metrics"]
    assert by_world[2] == pytest.approx(by_world[1], abs=1e-5), "world 2's global mean differs from world 1"
