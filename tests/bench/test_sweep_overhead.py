"""bench.sweep_overhead's timing loop against a fake API speaking the sweep contract (no stack)."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.start_latency import SPEC
from bench.sweep_overhead import LR, SWEEP, sweep_trial_start


def test_the_sweep_holds_the_plain_job_and_nothing_else() -> None:
    assert SWEEP["base"]["hyperparameters"] == SPEC["hyperparameters"] and SPEC["hyperparameters"]["lr"] == LR
    assert SWEEP["max_trials"] == 1 and SWEEP["space"] == {"hyperparameters.lr": {"choice": [LR]}}


def _server(final: str) -> httpx.Client:
    gets = {"sweep": 0, "metrics": 0}

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/sweeps":
            assert json.loads(request.content)["base"]["recipe"] == "mlp"
            return httpx.Response(201, json={"id": "sw1", "state": "running", "trials": []})
        if path == "/v1/sweeps/sw1":
            gets["sweep"] += 1
            trials = [{"number": 0, "job_id": "j1", "status": "running"}] if gets["sweep"] > 1 else []
            return httpx.Response(
                200, json={"id": "sw1", "state": final if gets["sweep"] > 3 else "running", "trials": trials}
            )
        if path == "/v1/jobs/j1":
            return httpx.Response(200, json={"id": "j1", "status": "running", "error": None})
        if path == "/v1/jobs/j1/metrics":
            gets["metrics"] += 1
            return httpx.Response(
                200, json={"job_id": "j1", "series": {"loss": [[1, 0.5]] if gets["metrics"] > 1 else []}}
            )
        return httpx.Response(404)

    return httpx.Client(base_url="http://bench", transport=httpx.MockTransport(handle))


def test_timed_until_the_trials_first_point_then_awaited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bench.sweep_overhead.time.sleep", lambda _s: None)
    assert sweep_trial_start(_server("succeeded")) > 0
    with pytest.raises(RuntimeError, match="ended failed"):
        sweep_trial_start(_server("failed"))
