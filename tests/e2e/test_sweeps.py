"""Sweeps on the production shape: `dptrain api` + `dptrain worker` on PostgreSQL and Redis.

One stack for the module, its node 4 slots wide (two 2-rank trials at once) and every step slowed
by the `sleep` fault (100 ms), so that a pruned trial is still running when ASHA decides.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import REDIS_URL
from tests.e2e.helpers import wait_healthy
from tests.e2e.stack import Stack, running_stack
from tests.e2e.sweep_scenario import run_asha_sweep, run_random_sweep
from workers.sandbox.procs import rank_processes

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        tmp_path_factory.mktemp("sweeps"),
        broker_url=REDIS_URL,
        DPTRAIN_NODE_SLOTS="4",
        DPTRAIN_FAULT_INJECT="sleep:ms=100",
        DPTRAIN_REPORT_INTERVAL_SECONDS="0.2",
    ) as stack:
        yield stack


def test_a_random_sweep_survives_an_api_crash_mid_sweep_losing_and_repeating_no_trial(stack: Stack) -> None:
    base = str(stack.http.base_url)

    def restart() -> None:
        # A crash (SIGKILL, mid-round or not), then a new API process on the same database.
        stack.procs.kill("api")
        stack.procs.start("api", ["api", "--port", str(stack.http.base_url.port)], stack.env)
        wait_healthy(base, stack.procs)

    run_random_sweep(stack.http, stack.procs, restart=restart)


def test_asha_prunes_the_clearly_worse_trial_and_its_ranks_are_gone(stack: Stack) -> None:
    run_asha_sweep(stack.http, stack.procs, ranks_of=rank_processes)
