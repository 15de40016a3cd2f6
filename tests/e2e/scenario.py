"""The end-to-end scenario both deployments must pass: mlp on 2 ranks over HTTP, followed and checked."""

from __future__ import annotations

import io
from typing import Any

import httpx
import torch

from tests.conftest import job_spec
from tests.e2e.helpers import Procs, wait_for_terminal

SPEC: dict[str, Any] = job_spec(
    name="e2e-mlp",
    hyperparameters={"global_batch_size": 16, "steps": 6, "lr": 0.1, "momentum": 0.9, "hidden_size": 16},
    resources={"processes_per_node": 2, "device": "cpu"},
    checkpoint={"every_steps": 3, "keep_last": 5},
    labels={"suite": "e2e"},
)


def run_mlp_scenario(http: httpx.Client, procs: Procs) -> dict[str, Any]:
    """Submit, poll to succeeded, and check metrics, logs, checkpoints and the download."""
    r = http.post("/v1/jobs", json=SPEC)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = wait_for_terminal(http, job_id, procs=procs)
    assert job["status"] == "succeeded", (
        f"expected succeeded, got {job['status']}: {job['error']}\n{procs.logs()}"
    )
    assert job["progress"] == {"step": 6, "total_steps": 6}
    assert job["attempt"] == 1 and job["started_at"] and job["finished_at"]
    assert "loss" in job["latest_metrics"]

    series = http.get(f"/v1/jobs/{job_id}/metrics").json()["series"]
    assert [s for s, _ in series["loss"]] == [1, 2, 3, 4, 5, 6], (
        f"one loss point per step, got {series['loss']}"
    )

    lines = http.get(f"/v1/jobs/{job_id}/logs", params={"limit": 5000}).json()["items"]
    ranks = {ln["rank"] for ln in lines}
    assert {0, 1} <= ranks, f"expected output of ranks 0 and 1, got ranks {ranks}"

    ckpts = http.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
    assert [c["step"] for c in ckpts] == [3, 6], f"checkpoints every 3 steps and at the end, got {ckpts}"
    last = ckpts[-1]
    r = http.get(f"/v1/jobs/{job_id}/checkpoints/{last['id']}/download")
    assert r.status_code == 200
    assert len(r.content) == last["size_bytes"]
    import hashlib

    assert hashlib.sha256(r.content).hexdigest() == last["sha256"]
    state = torch.load(io.BytesIO(r.content), weights_only=True)
    assert state["iter"] == 6
    assert state["model"], "the checkpoint holds the model's state_dict"
    assert not any(k.startswith("module.") for k in state["model"]), list(state["model"])
    return dict(job)
