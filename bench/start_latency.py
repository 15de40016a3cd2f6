"""Job start latency: submit to the first training step reported, against a bare torchrun hello-world.

    python -m bench.start_latency [--smoke] [--json OUT]

dptrain side: `dptrain api` + one `dptrain worker` on PostgreSQL + Redis (loopback, production
defaults, including the worker's 0.5 s report interval, except the per-token rate limit, off
because the client polls faster than 20/s), already up and idle. Two such stacks run side by side:
one whose worker starts the ranks in the sandbox (DPTRAIN_SANDBOX=required, so a run without a
working sandbox fails instead of measuring the wrong thing), one with DPTRAIN_SANDBOX=off. A client POSTs a
2-process `mlp` job and polls `GET /v1/jobs/{id}/metrics` every 10 ms; the latency is from just
before the POST to the first answer holding a point (step 1's metrics: the engine logs every
step). That covers the API, the commit, the Redis publish, the Celery delivery, the claim,
torchrun, two ranks importing torch and building the recipe, rendezvous, the first step, the
events file, the reporter's tick and the read. The job is then awaited to its end before the next.

Baseline: the wall time of `python -m torch.distributed.run --standalone --nproc-per-node 2
bench/baselines/hello.py` (init Gloo, one allreduce, print, exit). A round runs a sandboxed job, an
unsandboxed job and the hello-world, each round starting one further on (bench.common.rotated);
each ratio is taken within a round: sandboxed / torchrun (the bar: the sandbox is the default),
unsandboxed / torchrun, and sandboxed / unsandboxed (what the sandbox itself costs).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from api_schemas import JobStatus
from bench.common import ROOT, Result, bench_env, cli, ratio_of, result, rotated, spread
from bench.stack import running_stack

BAR = 1.3
HELLO = ROOT / "bench" / "baselines" / "hello.py"
SPEC = {
    "name": "bench-start",
    "recipe": "mlp",
    "hyperparameters": {"global_batch_size": 64, "steps": 3, "lr": 0.05},
    "resources": {"processes_per_node": 2, "device": "cpu"},
}


def job_start(http: httpx.Client, *, spec: Mapping[str, Any] = SPEC, timeout: float = 120) -> float:
    """Submit `spec`, return seconds to the first metric point; then wait for the job to end."""
    start = time.perf_counter()
    r = http.post("/v1/jobs", json=spec)
    assert r.status_code == 201, f"submit: expected 201, got {r.status_code} {r.text[:300]}"
    job_id = r.json()["id"]
    deadline = start + timeout
    latency = None
    while time.perf_counter() < deadline:
        m = http.get(f"/v1/jobs/{job_id}/metrics")
        if m.status_code == 200 and any(m.json()["series"].values()):
            latency = time.perf_counter() - start
            break
        time.sleep(0.01)
    if latency is None:
        raise RuntimeError(
            f"job {job_id} reported no step within {timeout} s: {http.get(f'/v1/jobs/{job_id}').text}"
        )
    while time.perf_counter() < deadline:
        r = http.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, f"GET job: expected 200, got {r.status_code} {r.text[:300]}"
        job = r.json()
        status = JobStatus(job["status"])
        if status.is_terminal():
            if status is not JobStatus.SUCCEEDED:
                raise RuntimeError(f"job {job_id} ended {job['status']}: {job.get('error')}")
            return latency
        time.sleep(0.05)
    raise RuntimeError(f"job {job_id} did not finish within {timeout} s")


def torchrun_hello() -> float:
    """Wall seconds of a bare two-process torchrun hello-world."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HELLO)],
        cwd=ROOT,
        env=bench_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun hello failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return elapsed


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run(smoke: bool = False) -> dict[str, Result]:
    """Rotated rounds of a sandboxed job start, an unsandboxed one and a torchrun hello-world."""
    rounds = 1 if smoke else 6
    with (
        tempfile.TemporaryDirectory(prefix="dptrain-bench-start-") as tmp,
        running_stack(_folder(tmp, "sandboxed"), worker=True, DPTRAIN_SANDBOX="required") as on,
        running_stack(_folder(tmp, "unsandboxed"), worker=True, DPTRAIN_SANDBOX="off") as off,
        on.client() as on_http,
        off.client() as off_http,
    ):
        sides = {
            "sandboxed": lambda: job_start(on_http),
            "unsandboxed": lambda: job_start(off_http),
            "torchrun": torchrun_hello,
        }
        t = rotated(sides, rounds, warmup=0 if smoke else 1)
    sandboxed, unsandboxed, torchrun = t["sandboxed"], t["unsandboxed"], t["torchrun"]
    medians = (
        f"medians: sandboxed {_median(sandboxed):.2f} s, unsandboxed {_median(unsandboxed):.2f} s, "
        f"torchrun hello {_median(torchrun):.2f} s ({rounds} rounds)"
    )

    def figure(**detail: Any) -> Result:
        return result(benchmark="3. Job start", unit="x (time ratio)", smoke=smoke, **detail)

    job = "submit to first step's metrics visible in the API (2-rank mlp job"
    hello = "wall time of a bare 2-process torchrun hello-world"
    return {
        "start_latency_vs_torchrun": figure(
            compared=f"{job}, ranks sandboxed) / {hello}",
            **_ratios(sandboxed, torchrun),
            bar=BAR,
            higher_is_better=False,
            dptrain_s=sandboxed,
            torchrun_s=torchrun,
            notes=[medians],
        ),
        "start_latency_unsandboxed_vs_torchrun": figure(
            compared=f"{job}, DPTRAIN_SANDBOX=off) / {hello}",
            **_ratios(unsandboxed, torchrun),
            bar=None,
            higher_is_better=False,
            dptrain_s=unsandboxed,
            torchrun_s=torchrun,
        ),
        "start_latency_sandboxed_vs_unsandboxed": figure(
            compared="the same job start, ranks sandboxed / DPTRAIN_SANDBOX=off",
            **_ratios(sandboxed, unsandboxed),
            bar=None,
            higher_is_better=False,
        ),
    }


def _folder(tmp: str, name: str) -> Path:
    path = Path(tmp) / name
    path.mkdir()
    return path


def _ratios(a: list[float], b: list[float]) -> dict[str, float]:
    """result()'s ratio (median) and spread of a / b, taken round by round."""
    return ratio_of(spread([x / y for x, y in zip(a, b, strict=True)]))


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """CLI entry point."""
    return cli("bench.start_latency", __doc__, run, argv)


if __name__ == "__main__":
    main()
