"""Sweeps over HTTP on a running service: the scenario both deployments must pass, and ASHA's.

A sweep's trials are 2-rank `mlp` jobs run by the service's own worker; the test only submits,
watches and checks, as a user would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import job_spec
from tests.e2e.helpers import Procs

LIVE = ("queued", "running")


def mlp_base(steps: int, **hyperparameters: Any) -> dict[str, Any]:
    """A 2-rank CPU `mlp` job, reporting `loss` every step."""
    return job_spec(
        name="sweep-base",
        hyperparameters={"global_batch_size": 8, "steps": steps, "hidden_size": 16, **hyperparameters},
        resources={"processes_per_node": 2, "device": "cpu"},
        engine={"log_every_steps": 1},
    )


def submit(http: httpx.Client, body: dict[str, Any]) -> str:
    r = http.post("/v1/sweeps", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def follow(
    http: httpx.Client,
    sweep_id: str,
    *,
    procs: Procs,
    timeout: float = 240,
    each: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], int]:
    """Poll a sweep to its end: (the ended sweep, the most trials seen queued or running at once)."""
    deadline, most = time.monotonic() + timeout, 0
    while True:
        r = http.get(f"/v1/sweeps/{sweep_id}")
        assert r.status_code == 200, r.text
        sweep = r.json()
        most = max(most, sum(t["status"] in LIVE for t in sweep["trials"]))
        if sweep["state"] != "running":
            return sweep, most
        assert time.monotonic() < deadline, f"sweep still running: {sweep}\n{procs.logs()}"
        if each is not None:
            each(sweep)
        procs.check_alive()
        time.sleep(0.3)


def run_random_sweep(
    http: httpx.Client, procs: Procs, *, restart: Callable[[], None] | None = None
) -> dict[str, Any]:
    """6 random trials, at most 2 at once; `restart` (the API's) is called once, mid-sweep."""
    body = {
        "name": "mlp-lr",
        "base": mlp_base(4),
        "space": {"hyperparameters.lr": {"log_uniform": [1e-3, 0.3]}},
        "objective": {"metric": "loss", "direction": "minimize"},
        "max_trials": 6,
        "max_concurrent_trials": 2,
        "seed": 3,
    }
    sweep_id = submit(http, body)
    restarted: list[int] = []

    def mid_sweep(sweep: dict[str, Any]) -> None:
        ended = [t for t in sweep["trials"] if t["status"] not in LIVE]
        if restart is not None and not restarted and ended and len(sweep["trials"]) < 6:
            restarted.append(len(sweep["trials"]))
            restart()

    sweep, most = follow(http, sweep_id, procs=procs, each=mid_sweep)
    assert restart is None or restarted, "the sweep ended before the API could be restarted in it"
    assert sweep["state"] == "succeeded", f"{sweep}\n{procs.logs()}"
    trials = sweep["trials"]
    # Neither lost nor repeated: six numbered trials, six jobs, and no other job of the sweep.
    assert [t["number"] for t in trials] == list(range(6)), trials
    assert [t["status"] for t in trials] == ["succeeded"] * 6, trials
    labelled = http.get("/v1/jobs", params={"label": f"sweep={sweep_id}", "limit": 100}).json()["items"]
    assert sorted(j["id"] for j in labelled) == sorted(t["job_id"] for t in trials)
    assert len({t["params"]["hyperparameters.lr"] for t in trials}) == 6
    assert 1 <= most <= 2, most
    for trial in trials:
        job = http.get(f"/v1/jobs/{trial['job_id']}").json()
        # Every rank ran with the trial's parameters: they are in its spec.
        assert job["spec"]["hyperparameters"]["lr"] == trial["params"]["hyperparameters.lr"]
        loss = http.get(f"/v1/jobs/{trial['job_id']}/metrics", params={"name": "loss"}).json()
        assert trial["objective"] == loss["series"]["loss"][-1][1] and trial["steps"][-1][0] == 4
    assert sweep["best"]["objective"] == min(t["objective"] for t in trials)
    assert sweep["best"]["job_id"] == min(trials, key=lambda t: t["objective"])["job_id"]
    return sweep


def run_asha_sweep(
    http: httpx.Client, procs: Procs, *, ranks_of: Callable[[str], list[Any]]
) -> dict[str, Any]:
    """Two trials in turn, the second with lr 1e-6 (its loss hardly moves): ASHA prunes it at its first rung.

    The grid sampler with seed 1 asks lr 0.2 first, then 1e-6 (asserted below: the order is
    Optuna's, seeded); `ranks_of(job_id)` lists a job's rank processes still alive on this host.
    """
    body = {
        "name": "mlp-asha",
        "base": mlp_base(60, lr=0.2, momentum=0.9),
        "space": {"hyperparameters.lr": {"choice": [0.2, 1e-6]}},
        "objective": {"metric": "loss", "direction": "minimize"},
        "sampler": "grid",
        "pruner": {"type": "asha", "min_resource": 10, "reduction_factor": 2},
        "max_trials": 2,
        "max_concurrent_trials": 1,
        "seed": 1,
    }
    sweep, most = follow(http, submit(http, body), procs=procs)
    assert sweep["state"] == "succeeded" and most == 1, f"{sweep}\n{procs.logs()}"
    good, bad = sweep["trials"]
    assert (good["params"], bad["params"]) == ({"hyperparameters.lr": 0.2}, {"hyperparameters.lr": 1e-6})
    assert (good["status"], bad["status"]) == ("succeeded", "pruned"), sweep["trials"]
    # Stopped past its first rung (step 10) and well before its last step.
    assert 10 <= bad["steps"][-1][0] < 60, bad["steps"]
    job = http.get(f"/v1/jobs/{bad['job_id']}").json()
    assert job["status"] == "pruned" and job["finished_at"], job
    assert ranks_of(bad["job_id"]) == [], "a pruned trial's ranks must be gone once it has ended"
    assert sweep["best"]["job_id"] == good["job_id"]
    return sweep
