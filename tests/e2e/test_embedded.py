"""End to end on the embedded default: `dptrain up` with SQLite and a serverless queue, no server at all:
the mlp scenario, then the sweeps of tests/e2e/sweep_scenario.py (every step slowed by the `sleep`
fault, 100 ms, so that ASHA decides while the trial it prunes still runs)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import Procs, clean_env, wait_healthy
from tests.e2e.scenario import run_mlp_scenario
from tests.e2e.sweep_scenario import run_asha_sweep, run_random_sweep
from workers.sandbox.procs import rank_processes

pytestmark = pytest.mark.e2e


def test_dptrain_up_runs_a_job_with_no_servers(tmp_path: Path, free_port: Callable[[], int]) -> None:
    home = tmp_path / "home"
    env = clean_env(
        DPTRAIN_HOME=str(home), DPTRAIN_REPORT_INTERVAL_SECONDS="0.2", DPTRAIN_FAULT_INJECT="sleep:ms=100"
    )
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

            def restart() -> None:
                # `up` stopped as systemd stops it, mid-sweep, and started again on the same home.
                procs.signal("up", signal.SIGTERM, timeout=30)
                procs.start("up", ["up", "--port", str(port)], env, cwd=tmp_path)
                wait_healthy(base, procs, timeout=90)

            run_random_sweep(http, procs, restart=restart)
            run_asha_sweep(http, procs, ranks_of=rank_processes)
        assert (home / "dptrain.db").is_file() and (home / "broker.db").is_file()
        # Everything the API, the worker and the ranks wrote is private (docs/security.md); the home
        # folder itself is `up`'s to create, and the code cache is 0711 on purpose.
        written = [p for p in home.rglob("*") if not p.is_symlink() and "code-cache" not in p.parts]
        shared = [str(p) for p in written if p.lstat().st_mode & 0o077]
        assert not shared, f"expected no group or other bit under DPTRAIN_HOME: {shared}"
    finally:
        procs.stop()
