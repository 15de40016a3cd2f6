"""Why a node stops its ranks: which reason wins, which are asked first, and how soon they are killed."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from workers.attempt import runner, watch
from workers.attempt.watch import ASKED_FIRST, SHUTDOWN_GRACE_SECONDS, StopReason, Watch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watch(tmp_path: Path, *, grace: float = 10.0) -> tuple[Watch, Clock]:
    clock = Clock()
    return Watch(stall_seconds=60, grace=grace, stop_file=tmp_path / "stop", clock=clock), clock


def test_the_reasons_keep_the_names_the_logs_show() -> None:
    # `job ...: stopping its ranks (stall)`: operators grep these.
    assert [str(r) for r in StopReason] == [
        "cancel",
        "fenced",
        "shutdown",
        "deadline",
        "stall",
        "outputs",
        "checkpoints",
    ]


@pytest.mark.parametrize("reason", list(StopReason))
def test_a_command_is_asked_first_only_for_a_cancel_or_its_deadline(
    tmp_path: Path, reason: StopReason
) -> None:
    w, clock = _watch(tmp_path)
    w.stop(reason)
    asked = reason in (StopReason.CANCEL, StopReason.DEADLINE)
    assert (reason in ASKED_FIRST) is asked
    assert (tmp_path / "stop").exists() is asked, f"{reason}: expected the stop file written: {asked}"
    assert w.stopped_for is reason
    if asked:
        assert not w.signal_due(), f"{reason}: signalled before the grace to stop by itself"
        clock.now += 10.5
    assert w.signal_due(), f"{reason}: never signalled"
    assert not w.signal_due(), "signalled twice"


def test_a_stop_for_shutdown_kills_within_docker_stop_s_wait(tmp_path: Path) -> None:
    w, _ = _watch(tmp_path, grace=30.0)
    w.stop(StopReason.CANCEL)
    assert w.kill_after() == 30.0
    w.stop(StopReason.SHUTDOWN)
    assert w.kill_after() == SHUTDOWN_GRACE_SECONDS


class Over:
    def __init__(self, over: bool) -> None:
        self._over = over

    def over(self) -> bool:
        return self._over


def _reason(
    *,
    cancel: bool = False,
    fenced: bool = False,
    shutdown: bool = False,
    deadline: bool = False,
    stalled: bool = False,
    outputs: bool = False,
    checkpoints: bool = False,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> StopReason | None:
    state = SimpleNamespace(cancel_requested=cancel, fenced_out=fenced)
    w, clock = _watch(tmp_path)
    if stalled:
        clock.now += 61
    monkeypatch.setattr(watch.stopping, "is_set", lambda: shutdown)
    past = time.monotonic() - 1 if deadline else None
    guards: Any = (Over(outputs), Over(checkpoints))
    return runner._stop_reason(SimpleNamespace(state=state), w, past, guards)


ORDER = ["cancel", "fenced", "shutdown", "deadline", "stalled", "outputs", "checkpoints"]


@pytest.mark.parametrize("first", range(len(ORDER)), ids=ORDER)
def test_the_first_reason_that_applies_wins(
    first: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A cancel decides even when the job is also past its deadline (it ends cancelled, not failed);
    # a fenced run records nothing, whatever else applies.
    applying = {name: i >= first for i, name in enumerate(ORDER)}
    got = _reason(**applying, monkeypatch=monkeypatch, tmp_path=tmp_path)
    assert got is list(StopReason)[first], f"with {[n for n, on in applying.items() if on]}: {got}"


def test_no_reason_no_stop(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _reason(monkeypatch=monkeypatch, tmp_path=tmp_path) is None
