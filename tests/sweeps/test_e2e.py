"""A real sweep: the driver's rounds start trials of the `mlp` recipe, run by the runner (2-rank torchrun).

Three tiny trials (4 steps), at most 2 at once: the driver never has more than 2 queued or running,
and the sweep ends naming the trial whose reported loss is the least.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.config import Settings
from service.models import Job, SweepTrial
from service.sweeps import driver
from tests.conftest import job_spec
from tests.workers.runs import admin_api_fixture, node_fixtures, run_in_thread

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()
api = admin_api_fixture()


def test_a_random_sweep_runs_at_most_two_trials_at_once_and_names_the_least_loss(
    api: TestClient, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    base = job_spec(
        name="sweep-base",
        hyperparameters={"global_batch_size": 8, "steps": 4, "hidden_size": 16},
        resources={"processes_per_node": 2},
    )
    body: dict[str, Any] = {
        "name": "mlp-lr",
        "base": base,
        "space": {"hyperparameters.lr": {"log_uniform": [1e-3, 0.3]}},
        "objective": {"metric": "loss", "direction": "minimize"},
        "max_trials": 3,
        "max_concurrent_trials": 2,
        "seed": 3,
    }
    r = api.post("/v1/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    started: dict[str, threading.Thread] = {}
    most = 0
    deadline = time.monotonic() + 300
    while api.get(f"/v1/sweeps/{sweep_id}").json()["state"] == "running":
        assert time.monotonic() < deadline, api.get(f"/v1/sweeps/{sweep_id}").json()
        driver.run_once(sessions=sessions, settings=settings)
        with sessions() as s:
            jobs = s.scalars(
                select(Job)
                .join(SweepTrial, SweepTrial.job_id == Job.id)
                .where(SweepTrial.sweep_id == sweep_id)
            ).all()
        live = [j for j in jobs if not JobStatus(j.status).is_terminal()]
        most = max(most, len(live))
        assert len(live) <= 2
        for job in live:  # the node's worker: each queued trial is placed here and run
            if job.status == JobStatus.QUEUED.value and job.id not in started:
                started[job.id] = run_in_thread(settings, job.id)[0]
        time.sleep(0.3)
    for thread in started.values():
        thread.join(timeout=60)
    shown = api.get(f"/v1/sweeps/{sweep_id}").json()
    assert shown["state"] == "succeeded" and most == 2 and len(shown["trials"]) == 3
    assert [t["status"] for t in shown["trials"]] == ["succeeded"] * 3
    for trial in shown["trials"]:
        assert trial["objective"] == trial["steps"][-1][1] and trial["steps"][-1][0] == 4
    assert shown["best"]["objective"] == min(t["objective"] for t in shown["trials"])
    assert len({t["params"]["hyperparameters.lr"] for t in shown["trials"]}) == 3
