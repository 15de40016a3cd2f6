"""`dptrain up`'s restart policy for a dead worker: doubling while it dies young, reset once it lived."""

from __future__ import annotations

from dptrain_server.supervise import Backoff


def test_quick_deaths_double_the_wait_up_to_its_ceiling() -> None:
    backoff = Backoff(first=1.0, most=30.0, healthy_after=60.0)
    waits = [backoff.delay(lived=2.0) for _ in range(8)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0], waits


def test_a_child_that_lived_a_while_is_restarted_after_the_first_wait_again() -> None:
    backoff = Backoff(first=1.0, most=30.0, healthy_after=60.0)
    assert [backoff.delay(lived=5.0) for _ in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff.delay(lived=60.0) == 1.0, "a minute of life resets the backoff"
    assert backoff.delay(lived=1.0) == 2.0, "and a quick death after that doubles it again"


def test_the_first_death_waits_the_first_delay_however_short_its_life() -> None:
    assert Backoff(first=0.5).delay(lived=0.0) == 0.5
    assert Backoff(first=0.5).delay(lived=3600.0) == 0.5
