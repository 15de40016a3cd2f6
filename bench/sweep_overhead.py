"""Per-trial overhead of a sweep: submit to first step of a sweep's trial, against a plain job's.

    python -m bench.sweep_overhead [--smoke] [--json OUT]

One stack, as bench.start_latency runs it: `dptrain api` + one `dptrain worker` on PostgreSQL +
Redis, ranks sandboxed (DPTRAIN_SANDBOX=required), already up and idle.

A: `POST /v1/sweeps` of a one-trial sweep whose base is the 2-process `mlp` job of
bench.start_latency and whose space holds one value (`hyperparameters.lr: {choice: [0.05]}`), so
the trial is that very job; timed from just before the POST to the first answer of the trial's
`GET /v1/jobs/{id}/metrics` holding a point. That adds what a sweep costs a trial: the study's
suggestion (Optuna on the service's database), creating the trial's job, finding its id in
`GET /v1/sweeps/{id}`. B: the same job submitted plainly, timed as bench.start_latency times it.
Each is awaited to its end (the sweep to `succeeded`) before the next; A and B alternate (ABBA) on
the same worker and the ratio is taken per round. Bar: at most 1.1 (issue 34).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.common import Result, cli, interleaved, ratio_of, result
from bench.stack import running_stack
from bench.start_latency import SPEC, job_start

BAR = 1.1
SWEEP_TERMINAL = {"succeeded", "cancelled", "failed"}
TRIAL_TERMINAL = {"succeeded", "cancelled", "failed", "pruned"}
LR = 0.05  # bench.start_latency's SPEC's: the one value of the space, so the trial is that job
SWEEP: dict[str, Any] = {
    "name": "bench-sweep",
    "base": {**SPEC, "name": "bench-sweep-trial"},
    "space": {"hyperparameters.lr": {"choice": [LR]}},
    "objective": {"metric": "loss", "direction": "minimize"},
    "sampler": "random",
    "pruner": {"type": "none"},
    "max_trials": 1,
    "max_concurrent_trials": 1,
    "seed": 0,
}
POLL_S = 0.01


def _ok(r: httpx.Response, what: str, status: int = 200) -> Any:
    if r.status_code != status:
        raise RuntimeError(f"{what}: expected {status}, got {r.status_code} {r.text[:300]}")
    return r.json()


def sweep_trial_start(
    http: httpx.Client, *, spec: Mapping[str, Any] = SWEEP, timeout: float = 120, poll_s: float = POLL_S
) -> float:
    """Submit a one-trial sweep, return seconds to its trial's first metric point; then await its end."""
    start = time.perf_counter()
    sweep_id = _ok(http.post("/v1/sweeps", json=dict(spec)), "submit sweep", 201)["id"]
    deadline = start + timeout
    job_id: str | None = None
    latency: float | None = None
    while time.perf_counter() < deadline:
        if job_id is None:
            trials = _ok(http.get(f"/v1/sweeps/{sweep_id}"), "GET sweep").get("trials", [])
            job_id = next((t["job_id"] for t in trials if t.get("job_id")), None)
        if job_id is not None:
            m = http.get(f"/v1/jobs/{job_id}/metrics")
            if m.status_code == 200 and any(m.json()["series"].values()):
                latency = time.perf_counter() - start
                break
            # A trial that ended before its first step would otherwise be waited on to the timeout.
            job = _ok(http.get(f"/v1/jobs/{job_id}"), "GET trial job")
            if job["status"] in TRIAL_TERMINAL:
                raise RuntimeError(
                    f"sweep {sweep_id}: trial job {job_id} ended {job['status']}: {job.get('error')}"
                )
        time.sleep(poll_s)
    if latency is None:
        raise RuntimeError(
            f"sweep {sweep_id}: no trial step within {timeout} s: {http.get(f'/v1/sweeps/{sweep_id}').text}"
        )
    while time.perf_counter() < deadline:
        sweep = _ok(http.get(f"/v1/sweeps/{sweep_id}"), "GET sweep")
        if sweep["state"] in SWEEP_TERMINAL:
            if sweep["state"] != "succeeded":
                raise RuntimeError(f"sweep {sweep_id} ended {sweep['state']}: {sweep.get('trials')}")
            return latency
        time.sleep(0.05)
    raise RuntimeError(f"sweep {sweep_id} did not end within {timeout} s")


def run(smoke: bool = False) -> dict[str, Result]:
    """Alternate one-trial sweeps with plain jobs of the same spec on one idle stack."""
    rounds = 2 if smoke else 10
    with (
        tempfile.TemporaryDirectory(prefix="dptrain-bench-sweep-") as tmp,
        running_stack(Path(tmp), worker=True, DPTRAIN_SANDBOX="required") as stack,
        stack.client() as http,
    ):
        m = interleaved(
            lambda: sweep_trial_start(http), lambda: job_start(http), rounds, warmup=0 if smoke else 1
        )
    medians = (
        f"medians: sweep trial {statistics.median(m['a_s']):.2f} s, "
        f"plain job {statistics.median(m['b_s']):.2f} s ({rounds} rounds, ABBA)"
    )
    return {
        "sweep_trial_overhead_vs_plain_job": result(
            benchmark="Sweeps (issue 34)",
            compared="submit to first step's metrics visible in the API: a one-trial sweep's trial "
            "(2-rank mlp, ranks sandboxed) / the same job submitted plainly",
            unit="x (time ratio)",
            **ratio_of(m),
            bar=BAR,
            higher_is_better=False,
            smoke=smoke,
            sweep_s=m["a_s"],
            plain_s=m["b_s"],
            notes=[medians],
        )
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """CLI entry point."""
    return cli("bench.sweep_overhead", __doc__, run, argv)


if __name__ == "__main__":
    main()
