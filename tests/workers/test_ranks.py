"""The runner drives a node's ranks through the `Ranks` seam alone (workers/attempt/ranks.py).

A fake `Ranks` stands in for torchrun: no process starts, and the runner still prepares the
attempt, starts the ranks, signals them at a cancel and ends them, recording the job's end.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.auth.tokens import ensure_bootstrap_admin
from service.config import Settings
from service.jobs import service
from tests.api_fixtures import ADMIN_TOKEN
from tests.conftest import job_spec
from tests.workers.runs import job_row, node_fixtures, place_here, statuses, submit_as_admin
from workers.attempt.node_run import NodeRun, RunPaths
from workers.attempt.runner import run_node
from workers.sandbox.rank_setup import RankSetup

settings, sessions = node_fixtures()


class FakeRanks:
    """Ranks that run until they are stopped, noting what the runner asked of them and when."""

    made: list[FakeRanks] = []

    def __init__(self, *, settings: Settings, run: NodeRun, paths: RunPaths) -> None:
        self.node, self.run, self.paths = settings.node, run, paths
        self.calls: list[tuple[str, Any]] = []
        self.started = threading.Event()
        self._rc: int | None = None
        FakeRanks.made.append(self)

    def unsandboxed(self) -> str | None:
        return None  # contained, as far as the runner can tell: it asks the ranks, not the host

    def clear_earlier(self) -> None:
        self.calls.append(("clear_earlier", None))

    def start(self, setup: RankSetup) -> None:
        self.calls.append(("start", setup))
        self.started.set()

    def poll(self) -> int | None:
        return self._rc

    def stop(self, *, grace: float) -> None:
        self.calls.append(("stop", grace))
        self._rc = -15  # as torchrun stopped by SIGTERM

    def end(self) -> int:
        self.calls.append(("end", self._rc))
        if self._rc is None:
            self._rc = -9
        return self._rc


def test_the_runner_starts_signals_at_a_cancel_and_ends_the_ranks_it_is_given(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    spec = job_spec(name="seam", hyperparameters={"global_batch_size": 8, "steps": 10_000_000})
    job_id = submit_as_admin(sessions, spec, settings=settings)
    attempt = place_here(settings, job_id=job_id)
    FakeRanks.made.clear()
    out: list[JobStatus | None] = []

    def deliver() -> None:
        out.append(
            run_node(job_id=job_id, attempt=attempt, node_rank=0, settings=settings, launcher=FakeRanks)
        )

    thread = threading.Thread(target=deliver)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not (FakeRanks.made and FakeRanks.made[0].started.is_set()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert FakeRanks.made and FakeRanks.made[0].started.is_set(), "the runner never started the ranks"
        [ranks] = FakeRanks.made
        assert ranks.node == settings.node and ranks.run.att.job_id == job_id and ranks.run.node_rank == 0
        assert [name for name, _ in ranks.calls] == ["clear_earlier", "start"], ranks.calls
        setup = ranks.calls[1][1]
        assert isinstance(setup, RankSetup) and setup.cwd.is_dir(), "prepared before they start"
        assert setup.env["DPTRAIN_JOB_ID"] == job_id, "the ranks' variables name their job"
        with sessions.begin() as s:
            admin = ensure_bootstrap_admin(s, token=ADMIN_TOKEN)
            service.cancel(s, user=admin, job_id=job_id)
        thread.join(timeout=60)
        assert not thread.is_alive(), f"the runner did not end after the cancel: {ranks.calls}"
    finally:
        if FakeRanks.made and thread.is_alive():
            FakeRanks.made[0].stop(grace=0)  # let a failing test's runner thread end
            thread.join(timeout=60)
    assert out == [JobStatus.CANCELLED], out
    # Stopped once with the operator's grace (an engine job has no stop file to be asked through
    # first), then ended: the runner never touches a process itself.
    assert [name for name, _ in ranks.calls] == ["clear_earlier", "start", "stop", "end"], ranks.calls
    assert ranks.calls[2] == ("stop", settings.cancel_grace_seconds) and ranks.calls[3] == ("end", -15)
    assert job_row(sessions, job_id).status == "cancelled"
    assert statuses(sessions, job_id) == ["queued", "running", "cancelled"]
