"""A user's own entrypoint, uploaded as a working directory, on `dptrain up` with nothing pre-installed.

No DPTRAIN_ALLOWED_ENTRYPOINTS and no PYTHONPATH on the server: the module exists only in the
uploaded tree (a copy of examples/, packed the way `dptrain submit --workdir` packs it).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from dptrain.workdir import pack
from tests.e2e.helpers import ROOT, Procs, clean_env, wait_for_terminal, wait_healthy

pytestmark = pytest.mark.e2e


def _final_state(http: httpx.Client, job_id: str) -> dict[str, Any]:
    items = http.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
    last = max(items, key=lambda c: c["step"])
    blob = http.get(f"/v1/jobs/{job_id}/checkpoints/{last['id']}/download").content
    return dict(torch.load(io.BytesIO(blob), weights_only=True))


def test_an_uploaded_entrypoint_runs_and_1_and_2_ranks_agree(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    home = tmp_path / "home"
    env = clean_env(DPTRAIN_HOME=str(home), DPTRAIN_REPORT_INTERVAL_SECONDS="0.2")
    env.pop("PYTHONPATH", None)  # the project is installed; the user's module is nowhere but the upload
    procs = Procs(tmp_path)
    port = free_port()
    procs.start("up", ["up", "--port", str(port)], env, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    packed = pack(ROOT / "examples", tmp_path / "code.tar.gz")
    try:
        wait_healthy(base, procs, timeout=90)
        token = (home / "token").read_text().strip()
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
            assert http.head(f"/v1/code/{packed.sha256}").status_code == 404
            put = http.put(f"/v1/code/{packed.sha256}", content=packed.path.read_bytes())
            assert put.status_code == 201, put.text
            jobs = []
            for ranks in (1, 2):
                spec = {
                    "name": f"uploaded-{ranks}",
                    "entrypoint": "custom_plan:build",
                    "code": {"sha256": packed.sha256},
                    "hyperparameters": {"global_batch_size": 8, "steps": 4, "lr": 0.01},
                    "resources": {"processes_per_node": ranks},
                    "checkpoint": {"every_steps": 4},
                }
                r = http.post("/v1/jobs", json=spec)
                assert r.status_code == 201, r.text
                assert r.json()["spec"]["code"] == {"sha256": packed.sha256}
                jobs.append(r.json()["id"])
            for job_id in jobs:
                job = wait_for_terminal(http, job_id, procs=procs, timeout=240)
                assert job["status"] == "succeeded", job
            one, two = (_final_state(http, j)["model"] for j in jobs)
            # Equal up to the order of float sums (a mean over 8 samples vs two means over 4), as in
            # tests/engine/test_equivalence.py.
            assert one.keys() == two.keys()
            diff = max(float((one[k] - two[k]).abs().max()) for k in one)
            assert diff <= 1e-6, f"world 2 differs from world 1 by {diff:.3e}"
    finally:
        procs.stop()
