"""End to end on the embedded default: `dptrain up` with SQLite and a serverless queue, no server at all:
the mlp scenario, then a sweep."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import Procs, clean_env, wait_healthy
from tests.e2e.scenario import run_mlp_scenario
from tests.e2e.sweep_scenario import run_random_sweep

pytestmark = pytest.mark.e2e


def test_dptrain_up_runs_a_job_with_no_servers(tmp_path: Path, free_port: Callable[[], int]) -> None:
    home = tmp_path / "home"
    env = clean_env(DPTRAIN_HOME=str(home), DPTRAIN_REPORT_INTERVAL_SECONDS="0.2")
    procs = Procs(tmp_path)
    port = free_port()
    procs.start("up", ["up", "--port", str(port)], env, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs, timeout=90)
        token = (home / "token").read_text().strip()
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
            assert http.get("/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
            run_mlp_scenario(http, procs)
            # A sweep of 6 two-rank trials, at most 2 at once, on SQLite and the serverless queue.
            run_random_sweep(http, procs)
        assert (home / "dptrain.db").is_file() and (home / "broker.db").is_file()
        # Everything the API, the worker and the ranks wrote is private (docs/security.md); the home
        # folder itself is `up`'s to create, and the code cache is 0711 on purpose.
        written = [p for p in home.rglob("*") if not p.is_symlink() and "code-cache" not in p.parts]
        shared = [str(p) for p in written if p.lstat().st_mode & 0o077]
        assert not shared, f"expected no group or other bit under DPTRAIN_HOME: {shared}"
    finally:
        procs.stop()
