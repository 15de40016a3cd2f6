"""What a rank hands the worker cannot wedge its job, nor grow without bound (issue 38, findings 3 and 4).

On the production stack (`dptrain api` + `dptrain worker`, PostgreSQL, Redis) with the sandbox
required, the jobs run tests/fixtures/rank_bytes/ranks.py, uploaded as their code: one prints NUL
and other control bytes and names a metric with a NUL (on PostgreSQL this used to stop every report
of the job and make its cancel wait for ever); one reports more metric points than the job's budget.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from dptrain.workdir import pack
from tests.conftest import REDIS_URL
from tests.e2e.helpers import ROOT, wait_for_terminal
from tests.e2e.stack import Stack, running_stack

pytestmark = pytest.mark.e2e

CODE_DIR = ROOT / "tests" / "fixtures" / "rank_bytes"
CAP = 1000
CAP_SETTING = "DPTRAIN_MAX_METRIC_POINTS_PER_JOB"  # what the warning names, as a user reads it
# A cancel asks first (the stop file), then signals after the grace: short here, as an operator may set it.
CANCEL_GRACE_SECONDS = 2
CANCEL_WITHIN_SECONDS = 15


@dataclass
class Setup:
    stack: Stack
    code_sha: str

    def submit(self, name: str, *args: str) -> str:
        """Submit ranks.py with `args` as a command job; its id."""
        spec = {"name": name, "command": ["python", "ranks.py", *args], "code": {"sha256": self.code_sha}}
        r = self.stack.http.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def get(self, path: str, **params: Any) -> Any:
        r = self.stack.http.get(path, params=params)
        assert r.status_code == 200, r.text
        return r.json()

    def log(self, job_id: str) -> list[str]:
        return [item["line"] for item in self.get(f"/v1/jobs/{job_id}/logs", limit=5000)["items"]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """The production stack with the sandbox required and a small metric budget, and the jobs' code."""
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is required at {REDIS_URL} and could not be reached: {exc}")
    tmp = tmp_path_factory.mktemp("rank-bytes")
    packed = pack(CODE_DIR, tmp / "code.tar.gz")
    with running_stack(
        tmp,
        broker_url=REDIS_URL,
        DPTRAIN_SANDBOX="required",
        DPTRAIN_MAX_METRIC_POINTS_PER_JOB=str(CAP),
        DPTRAIN_CANCEL_GRACE_SECONDS=str(CANCEL_GRACE_SECONDS),
    ) as stack:
        put = stack.http.put(f"/v1/code/{packed.sha256}", content=packed.path.read_bytes())
        assert put.status_code == 201, put.text
        yield Setup(stack, packed.sha256)


def test_control_bytes_are_stored_escaped_progress_moves_and_a_cancel_ends_the_job(setup: Setup) -> None:
    job_id = setup.submit("control-bytes", "bytes")
    deadline = time.monotonic() + 180
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = setup.get(f"/v1/jobs/{job_id}")
        assert job["status"] in ("queued", "running"), f"{job}\n{setup.stack.procs.logs()}"
        if job["progress"]["step"] >= 3:
            break
        setup.stack.procs.check_alive()
        time.sleep(0.5)
    else:
        raise AssertionError(
            f"the job's progress never moved past step {job.get('progress')}: its reports are stuck\n"
            f"{setup.stack.procs.logs()}"
        )

    lines = setup.log(job_id)
    assert "before\\x00after \\x1b[2J bell\\x07 del\\x7f c1\\x85 end" in lines, lines[:20]
    assert "raw\\x00bytes \ufffd\ufffd" in lines, lines[:20]
    assert "tab\tstays" in lines, "a tab is text, not escaped"
    assert any(re.fullmatch(r"step \d+ \\x00", ln) for ln in lines), lines[:20]
    assert not any(ch in ln for ln in lines for ch in "\x00\x1b\x07\x7f\x85"), "nothing raw reaches a reader"
    series = setup.get(f"/v1/jobs/{job_id}/metrics")["series"]
    assert series.get("loss\\x00evil") == [[1, 1.0]], series.keys()
    assert len(series["ok"]) >= 3, series["ok"]

    asked = time.monotonic()
    assert setup.stack.http.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    job = wait_for_terminal(setup.stack.http, job_id, procs=setup.stack.procs, timeout=120)
    took = time.monotonic() - asked
    assert job["status"] == "cancelled", job
    assert took < CANCEL_WITHIN_SECONDS, (
        f"the cancel took {took:.1f} s, expected under {CANCEL_WITHIN_SECONDS}"
    )


def test_a_metric_flood_is_cut_at_the_budget_with_one_warning_and_the_job_succeeds(setup: Setup) -> None:
    job_id = setup.submit("metric-flood", "flood", str(5 * CAP))
    job = wait_for_terminal(setup.stack.http, job_id, procs=setup.stack.procs, timeout=240)
    lines = setup.log(job_id)
    assert job["status"] == "succeeded", f"{job['error']}\n{lines[-20:]}"

    series = setup.get(f"/v1/jobs/{job_id}/metrics")["series"]
    assert [step for step, _ in series["loss"]] == list(range(1, CAP + 1)), (
        f"expected exactly the first {CAP} points stored, got {len(series['loss'])}"
    )
    reasons = [t["reason"] or "" for t in setup.get(f"/v1/jobs/{job_id}/timeline")["items"]]
    assert sum(r.count(CAP_SETTING) for r in reasons) == 1, f"one warning on the timeline: {reasons}"
    assert sum(CAP_SETTING in ln for ln in lines) == 1, f"one warning in the log: {lines[-10:]}"
    assert job["progress"]["step"] == 5 * CAP, "the job's progress is its last step, past the cap"
    (flood,) = [ln for ln in lines if ln.startswith("FLOOD ")]
    seconds = float(flood.split(" in ")[1].split()[0])
    assert seconds < 10, f"the rank's report calls took {seconds} s: the budget must not slow them"
