"""The sandbox around a job's ranks, end to end: issue 30's findings, each tried on `dptrain up` as root.

One `dptrain up` serves the module, as the findings were made: the embedded default (SQLite, a token
file under DPTRAIN_HOME), run by root, with DPTRAIN_SANDBOX=required so that a worker without a
working sandbox fails these tests instead of passing them unsandboxed. Its DPTRAIN_HOME is 100
characters long, an ordinary length that puts every path under it past AF_UNIX's 108 bytes.

The jobs run tests/fixtures/sandbox_probe/probe.py, uploaded as the job's code: it tries what a
hostile job would and prints one `PROBE <label> <DENIED|GOT> ...` line per try, read back here from
the job's log.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from dptrain.workdir import pack
from tests.conftest import free_port, job_spec
from tests.e2e.helpers import ROOT, Procs, clean_env, wait_for_terminal, wait_healthy

pytestmark = pytest.mark.e2e

PROBE_DIR = ROOT / "tests" / "fixtures" / "sandbox_probe"
HOME_LENGTH = 100
# A job that hangs (a DataLoader whose workers cannot reach it) fails this quickly, rather than
# after the default half hour; a healthy job here writes a log line well within it, even on a busy host.
STALL_SECONDS = 90
JOB_TIMEOUT = 240
# A cancel asks a command job to stop, signals it after the cancel grace and SIGKILLs its sandbox
# after the same grace again: a job that ignores the signal is gone after both and a few seconds
# more, as on a cluster worker (where nothing is left unreaped to wait for).
CANCEL_GRACE_SECONDS = 2
CANCEL_SECONDS = 20


@dataclass
class Up:
    """A running `dptrain up`, an admin client of it, and the probe's uploaded code."""

    http: httpx.Client
    procs: Procs
    home: Path
    token: str
    code_sha: str

    def submit(self, spec: dict[str, Any]) -> str:
        """Submit `spec`; its job id."""
        r = self.http.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def finish(self, job_id: str) -> dict[str, Any]:
        """Wait for the job to end; it must have succeeded."""
        job = wait_for_terminal(self.http, job_id, procs=self.procs, timeout=JOB_TIMEOUT)
        assert job["status"] == "succeeded", (
            f"expected succeeded, got {job['status']}: {job['error']}\n"
            f"{self.log(job_id)}\n{self.procs.logs()}"
        )
        return job

    def probe(self, name: str, *args: str, ranks: int = 1) -> tuple[str, str]:
        """Run probe.py with `args` as a command job to success; its id and its log."""
        spec = {
            "name": name,
            "command": ["python", "probe.py", *args],
            "code": {"sha256": self.code_sha},
            "resources": {"processes_per_node": ranks},
            "stall_timeout_seconds": STALL_SECONDS,
        }
        job_id = self.submit(spec)
        self.finish(job_id)
        return job_id, self.log(job_id)

    def log(self, job_id: str) -> str:
        """Everything the job's ranks wrote."""
        r = self.http.get(f"/v1/jobs/{job_id}/logs", params={"limit": 5000})
        assert r.status_code == 200, r.text
        return "\n".join(item["line"] for item in r.json()["items"])


def _long_home(base: Path) -> Path:
    """A folder under `base` whose absolute path is exactly HOME_LENGTH characters long."""
    room = HOME_LENGTH - len(str(base)) - 1
    assert room >= 1, f"the test's temp folder {base} is too long to make a {HOME_LENGTH}-character home"
    home = base / ("h" * room)
    assert len(str(home)) == HOME_LENGTH
    return home


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`dptrain up` as this (root) test runs it, under a 100-character home, the sandbox required."""
    base = tmp_path_factory.mktemp("sandbox")
    home = _long_home(base)
    env = clean_env(
        DPTRAIN_HOME=str(home),
        DPTRAIN_REPORT_INTERVAL_SECONDS="0.2",
        DPTRAIN_SANDBOX="required",
        DPTRAIN_CANCEL_GRACE_SECONDS=str(CANCEL_GRACE_SECONDS),
    )
    procs = Procs(base)
    port = free_port()
    procs.start("up", ["up", "--port", str(port)], env, cwd=base)
    url = f"http://127.0.0.1:{port}"
    packed = pack(PROBE_DIR, base / "probe.tar.gz")
    try:
        wait_healthy(url, procs, timeout=90)
        token = (home / "token").read_text().strip()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
            put = http.put(f"/v1/code/{packed.sha256}", content=packed.path.read_bytes())
            assert put.status_code == 201, put.text
            yield Up(http, procs, home, token, packed.sha256)
    finally:
        procs.stop()


def _findings(log: str) -> dict[str, str]:
    """The probe's `PROBE <label> <outcome>` lines, by label."""
    found = {}
    for line in log.splitlines():
        if line.startswith("PROBE "):
            label, outcome = line.removeprefix("PROBE ").split(" ", 1)
            found[label] = outcome
    return found


def _servers(up: Up) -> dict[str, int]:
    """The host pids of the worker and the API that `dptrain up` started."""
    found = {}
    for child in psutil.Process(up.procs.popen("up").pid).children():
        try:
            cmd = child.cmdline()
        except psutil.Error:  # an orphan `up` adopted (it is their subreaper), exited and not yet reaped
            continue
        for role in ("worker", "api"):
            if role in cmd:
                found[role] = child.pid
    assert set(found) == {"worker", "api"}, f"expected up's worker and API among its children, got {found}"
    return found


def test_a_job_reads_no_secret_of_the_server_and_no_other_jobs_files(up: Up) -> None:
    # Another job's checkpoints, which the probe must neither list nor read.
    other = up.submit(
        job_spec(
            name="other",
            hyperparameters={"global_batch_size": 8, "steps": 2, "hidden_size": 8},
            checkpoint={"every_steps": 2},
        )
    )
    up.finish(other)
    other_dir = up.home / "artifacts" / "jobs" / other
    other_ckpts = other_dir / "checkpoints"
    ckpt_file = next(p for p in other_ckpts.iterdir() if p.is_file())
    servers = _servers(up)
    targets = {
        "token": up.home / "token",
        "database": up.home / "dptrain.db",
        "home": up.home,
        "jobs": up.home / "artifacts" / "jobs",
        "code-cache": up.home / "code-cache",
        "other-job": other_dir,
        "other-checkpoints": other_ckpts,
        "other-checkpoint-file": ckpt_file,
        "pid1-environ": Path("/proc/1/environ"),
        "worker-environ": Path(f"/proc/{servers['worker']}/environ"),
        "api-environ": Path(f"/proc/{servers['api']}/environ"),
    }
    me, log = up.probe("secrets", "secrets", *(f"{label}={path}" for label, path in targets.items()))

    findings = _findings(log)
    assert set(findings) == set(targets), f"expected a finding for each of {sorted(targets)}:\n{log}"
    got = {label: outcome for label, outcome in findings.items() if not outcome.startswith("DENIED")}
    # The folders above the job's own run directory and code tree may be listed (its mounts need
    # them), and then show nothing but the way to them: no token, database or other job's files.
    on_the_way = {"artifacts", "jobs", me, "code-cache", up.code_sha}
    for label in ("home", "jobs", "code-cache"):
        listed = got.get(label, "").removeprefix("GOT entries ").split(",")
        if label in got and set(listed) <= on_the_way:
            del got[label]
    assert not got, f"expected every read to fail, but the job got: {got}\n{log}"
    assert up.token not in log, f"the bootstrap token reached the job's log:\n{log}"
    assert other not in log, f"the other job's id reached the probe's log:\n{log}"
    assert "SQLite format 3" not in log, f"the job read the server's database:\n{log}"


def test_a_relative_write_is_not_seen_by_the_next_job_with_the_same_code(up: Up) -> None:
    _, first = up.probe("writes-out", "write-relative")
    assert _findings(first).get("write-relative") == "GOT written", (
        f"expected the job to write out/ckpt.pt in its working directory:\n{first}"
    )
    _, second = up.probe("reads-out", "read-relative")
    assert _findings(second).get("read-relative") == "DENIED absent", (
        f"the next job with the same code (sha256 {up.code_sha}) saw the first job's out/ckpt.pt:\n{second}"
    )
    cached = up.home / "code-cache" / up.code_sha / "out"
    assert not cached.exists(), f"a job's relative write landed in the shared code cache: {cached}"


def test_dataloader_workers_run_under_a_home_of_ordinary_length(up: Up) -> None:
    assert len(str(up.home)) == HOME_LENGTH
    engine = up.submit(
        job_spec(
            name="num-workers",
            hyperparameters={"global_batch_size": 8, "steps": 3, "hidden_size": 8},
            data={"num_workers": 2},
            stall_timeout_seconds=STALL_SECONDS,
        )
    )
    # The user's own DataLoader, in a command job, at the same time.
    script = up.submit(
        {
            "name": "script-workers",
            "command": ["python", "probe.py", "dataloader"],
            "code": {"sha256": up.code_sha},
            "stall_timeout_seconds": STALL_SECONDS,
        }
    )
    job = up.finish(engine)
    assert job["progress"]["step"] == 3, job["progress"]
    up.finish(script)
    log = up.log(script)
    assert _findings(log).get("dataloader") == "GOT sum 2016", f"expected the batches' sum 0+...+63:\n{log}"


def _leftovers(marker: str, roots: list[Path]) -> list[str]:
    found = []
    for root in roots:
        for folder, _dirs, files in os.walk(root):
            found += [os.path.join(folder, f) for f in files if f.startswith(marker)]
    return found


def test_scratch_is_removed_when_the_job_ends_and_logs_and_checkpoints_stay(up: Up) -> None:
    marker = f"scratch-{uuid.uuid4().hex}"
    spec = {
        "name": "scratch",
        "command": ["python", "probe.py", "scratch", marker],
        "code": {"sha256": up.code_sha},
        "stall_timeout_seconds": STALL_SECONDS,
    }
    job_id = up.submit(spec)
    roots = [up.home.parent, Path("/tmp"), Path("/dev/shm"), Path("/var/tmp")]
    try:
        _scratch_removed(up, job_id, marker, roots)
    finally:
        # An unsandboxed job leaves them on the host: this test's own files, named by its marker.
        for path in _leftovers(marker, roots):
            Path(path).unlink(missing_ok=True)


def _scratch_removed(up: Up, job_id: str, marker: str, roots: list[Path]) -> None:
    up.finish(job_id)
    log = up.log(job_id)
    written = {label for label, outcome in _findings(log).items() if outcome == "GOT written"}
    for place in ("tmpdir", "tmp", "cwd"):
        assert f"scratch-{place}" in written, f"expected the job to write its scratch file in {place}:\n{log}"
    # Everywhere the scratch could stay on the host: the whole test folder (DPTRAIN_HOME, the
    # artifacts, the code cache) and the host's temp folders. The worker may remove it just after
    # the job's end is recorded.
    deadline = time.monotonic() + 10
    while (left := _leftovers(marker, roots)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"expected no scratch file left 10 s after the job ended, found {left}"

    ckpts = up.http.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
    assert [c["step"] for c in ckpts] == [1], f"expected the job's checkpoint of step 1 to stay: {ckpts}"
    blob = up.http.get(f"/v1/jobs/{job_id}/checkpoints/{ckpts[0]['id']}/download")
    assert blob.status_code == 200 and len(blob.content) == ckpts[0]["size_bytes"]
    rank_log = up.home / "artifacts" / "jobs" / job_id / "attempt-1" / "node-0" / "logs" / "rank0.log"
    assert rank_log.is_file() and "scratch-cwd GOT written" in rank_log.read_text(), (
        f"expected the rank's log to stay at {rank_log}"
    )
    metrics = up.http.get(f"/v1/jobs/{job_id}/metrics").json()["series"]
    assert metrics.get("loss") == [[1, 0.5]], f"expected the reported metric to stay: {metrics}"


def _zombies(up: Up) -> list[psutil.Process]:
    """`up`'s children that exited and were never reaped."""
    found = []
    for child in psutil.Process(up.procs.popen("up").pid).children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:  # reaped since it was listed
            continue
    return found


def test_a_cancelled_job_s_sandbox_leaves_no_zombie_and_the_cancel_does_not_wait_for_one(up: Up) -> None:
    # Ignores SIGTERM: its sandbox is SIGKILLed, whose init `up` then adopts (it is its subreaper).
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
    code += "time.sleep(600)"
    job_id = up.submit(
        {"name": "cancelled", "command": ["python", "-c", code], "stall_timeout_seconds": STALL_SECONDS}
    )
    deadline = time.monotonic() + JOB_TIMEOUT
    while "up" not in up.log(job_id).split():
        job = up.http.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] in ("queued", "running") and time.monotonic() < deadline, (
            f"expected the job to run and print 'up': {job}\n{up.procs.logs()}"
        )
        time.sleep(0.2)
    began = time.monotonic()
    assert up.http.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    job = wait_for_terminal(up.http, job_id, procs=up.procs, timeout=120)
    took = time.monotonic() - began
    assert job["status"] == "cancelled", job
    assert took < CANCEL_SECONDS, (
        f"the cancel took {took:.0f} s; on a cluster worker it takes the two {CANCEL_GRACE_SECONDS} s "
        f"graces and a few seconds, well under {CANCEL_SECONDS} s:\n{up.procs.logs()}"
    )
    # Every sandbox of this module's jobs, this one's included, has exited: `up` reaped them all.
    deadline = time.monotonic() + 5
    while (left := _zombies(up)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"expected `up` to reap every process it adopted; zombies left: {[p.pid for p in left]}"
