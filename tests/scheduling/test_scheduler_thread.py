"""The placement thread: a kick after a quiet spell runs a round at once; a stream of kicks is spaced out."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from service.config import Settings
from service.scheduling import scheduler as scheduler_module
from service.scheduling.scheduler import MIN_GAP_SECONDS, Scheduler


class Rounds:
    """Stands in for `schedule_once`: records when each round starts; the first waits to be let go."""

    def __init__(self) -> None:
        self.started: list[float] = []
        self.release_first = threading.Event()

    def __call__(self, **_kw: Any) -> list[str]:
        self.started.append(time.monotonic())
        if len(self.started) == 1:
            assert self.release_first.wait(10)
        return []


def _wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_kicks_during_a_round_coalesce_into_one_more_round_a_gap_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rounds = Rounds()
    monkeypatch.setattr(scheduler_module, "schedule_once", rounds)
    # The periodic round is far away: only kicks start rounds here.
    s = Scheduler(sessions=None, dispatcher=None, settings=Settings(schedule_interval_seconds=600))  # type: ignore[arg-type]
    s.start()
    try:
        kicked_at = time.monotonic()
        s.kick()
        _wait_for(lambda: len(rounds.started) == 1)
        assert rounds.started[0] - kicked_at < 2.0, "a kick after a quiet spell runs a round at once"
        for _ in range(20):  # a stream of submits while the round runs
            s.kick()
        rounds.release_first.set()
        _wait_for(lambda: len(rounds.started) == 2)
        time.sleep(MIN_GAP_SECONDS * 3)
        assert len(rounds.started) == 2, f"20 kicks must make one more round, not {len(rounds.started) - 1}"
        assert rounds.started[1] - rounds.started[0] >= MIN_GAP_SECONDS
    finally:
        s.stop()
        s.join(10)
    assert not s.is_alive()


def test_trials_a_sweep_submits_are_placed_in_the_same_round(monkeypatch: pytest.MonkeyPatch) -> None:
    rounds = Rounds()
    rounds.release_first.set()
    monkeypatch.setattr(scheduler_module, "schedule_once", rounds)
    submitted = iter([True])  # the first round's driver submits trials, later ones nothing
    monkeypatch.setattr(scheduler_module.sweeps, "run_once", lambda **_kw: next(submitted, False))
    s = Scheduler(sessions=None, dispatcher=None, settings=Settings(schedule_interval_seconds=600))  # type: ignore[arg-type]
    s.start()
    try:
        s.kick()
        _wait_for(lambda: len(rounds.started) == 2)
        # Placed at once, not a kick and a gap later; and no more rounds after that.
        assert rounds.started[1] - rounds.started[0] < MIN_GAP_SECONDS
        time.sleep(MIN_GAP_SECONDS * 2)
        assert len(rounds.started) == 2
    finally:
        s.stop()
        s.join(10)
