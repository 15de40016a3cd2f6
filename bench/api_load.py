"""API throughput and latency at 50 concurrent clients, on PostgreSQL + Redis, load from another process.

    python -m bench.api_load [--smoke] [--json OUT] [--api-workers N]

`dptrain api` (uvicorn, `--api-workers` processes, default 2 on this 2-core target; rate limit off,
everything else the production defaults) on a fresh PostgreSQL database with Redis as the broker,
no worker (submitted jobs stay queued, each with its reason; placement runs in the API processes).
The load comes from a separate process holding 50 keep-alive connections in a closed loop (each
sends its next request when the answer arrives), sharing the 2 cores with the API and PostgreSQL:
Debian's `wrk` (one thread, `bench/wrk_report.lua`) where it is installed, as the issue suggests,
else `bench.loadgen` (Python; it takes about twice wrk's CPU per request from the server).

Three rounds (one in smoke mode) of three runs, each 8 s after a 2 s warm-up of the same kind;
the median round of each kind is reported, with the others as min and max:
- submits: `POST /v1/jobs` with a small `mlp` spec (each creates a queued job);
- polls: `GET /v1/jobs/{id}` answered 200 with the body;
- conditional polls: the same with `If-None-Match: <its ETag>`, answered 304.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import BENCH_TOKEN, ROOT, Result, bench_env, finish, result
from bench.stack import running_stack

SUBMITS_BAR, POLLS_BAR, P99_BAR_MS = 300.0, 2000.0, 50.0
ROUNDS = 3
CONCURRENCY = 50
SPEC = {
    "name": "bench-load",
    "recipe": "mlp",
    "hyperparameters": {"global_batch_size": 64, "steps": 100, "lr": 0.05},
    "resources": {"processes_per_node": 1, "device": "cpu"},
}


def generator() -> str:
    """`wrk` where Debian's package is installed (C: less CPU per request), else `bench.loadgen`."""
    return "wrk" if shutil.which("wrk") else "bench.loadgen"


def loadgen(
    url: str,
    *,
    method: str = "GET",
    headers: Sequence[str] = (),
    body: Path | None = None,
    duration: float,
    max_requests: int,
) -> dict[str, Any]:
    """Run the load generator as its own process and return its figures (bench.loadgen's JSON)."""
    all_headers = [f"Authorization: Bearer {BENCH_TOKEN}", *headers]
    if generator() == "wrk":
        return _wrk(url, method=method, headers=all_headers, body=body, duration=duration)
    cmd = [
        sys.executable,
        "-m",
        "bench.loadgen",
        f"--url={url}",
        f"--method={method}",
        f"--concurrency={CONCURRENCY}",
        f"--duration={duration}",
        f"--max-requests={max_requests}",
        *(f"--header={h}" for h in all_headers),
        *([f"--body-file={body}"] if body else []),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=duration + 120
    )
    if proc.returncode != 0:
        raise RuntimeError(f"loadgen failed: {proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout))


def _wrk(
    url: str, *, method: str, headers: Sequence[str], body: Path | None, duration: float
) -> dict[str, Any]:
    # One wrk thread holding CONCURRENCY keep-alive connections, a closed loop like bench.loadgen;
    # bench/wrk_report.lua builds the request and prints the figures with the count per status.
    env = bench_env(WRK_METHOD=method, WRK_BODY_FILE=str(body or ""), WRK_HEADERS="\n".join(headers))
    cmd = [
        "wrk",
        "-t1",
        f"-c{CONCURRENCY}",
        f"-d{max(1, round(duration))}s",
        "--timeout=30s",
        "-s",
        str(ROOT / "bench" / "wrk_report.lua"),
        url,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=duration + 120)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("WRK_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(line.removeprefix("WRK_JSON "))
    if out.pop("socket_errors"):
        out["statuses"]["socket error"] = 1  # fails the status check below: no request may fail
    out["per_s"] = out["requests"] / out["seconds"]
    out["concurrency"] = CONCURRENCY
    return out


def _settled_etag(http: Any, job_url: str, timeout: float = 30.0) -> str:
    """The job's ETag once placement has recorded why it waits (no worker runs in this benchmark).

    Placement writes `queued_reason` just after the submit, which changes the representation once;
    an ETag taken before that would never be answered 304.
    """
    deadline = time.monotonic() + timeout
    while True:
        r = http.get(job_url)
        if r.json().get("queued_reason") or time.monotonic() > deadline:
            return str(r.headers["etag"])
        time.sleep(0.1)


def _median_run(xs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput, with every run's rate (min, max) and the median of their p99s."""
    ordered = sorted(xs, key=lambda x: float(x["per_s"]))
    mid = dict(ordered[len(ordered) // 2])
    mid["all_per_s"] = [float(x["per_s"]) for x in xs]
    mid["p99_all_ms"] = [float(x["p99_ms"]) for x in xs]
    mid["p99_ms"] = statistics.median(mid["p99_all_ms"])
    return mid


def run(smoke: bool = False, api_workers: int | None = None) -> dict[str, Result]:
    """Submits, polls, conditional polls."""
    duration, warmup, rounds = (1.0, 0.3, 1) if smoke else (8.0, 2.0, ROUNDS)
    api_workers = api_workers or (1 if smoke else 2)
    all_runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="dptrain-bench-api-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps(SPEC))
        with running_stack(Path(tmp), worker=False, api_workers=api_workers) as stack, stack.client() as http:
            r = http.post("/v1/jobs", json=SPEC)
            assert r.status_code == 201, r.text
            job_url = f"{stack.base_url}/v1/jobs/{r.json()['id']}"
            etag = _settled_etag(http, job_url)
            kinds: dict[str, dict[str, Any]] = {
                "submits": {"url": f"{stack.base_url}/v1/jobs", "method": "POST", "body": spec},
                "polls": {"url": job_url},
                "polls_304": {"url": job_url, "headers": [f"If-None-Match: {etag}"]},
            }
            # Rounds of the three kinds in turn, so that a busy spell of the shared machine hits
            # each kind in one round rather than one kind in every round; medians are reported.
            for _ in range(rounds):
                for name, kw in kinds.items():
                    loadgen(**kw, duration=warmup, max_requests=1_000_000)
                    got = loadgen(**kw, duration=duration, max_requests=1_000_000)
                    expected = {"submits": "201", "polls": "200", "polls_304": "304"}[name]
                    assert set(got["statuses"]) == {expected}, (
                        f"{name}: expected only {expected}, got {got['statuses']}"
                    )
                    all_runs.setdefault(name, []).append(got)
    runs = {name: _median_run(xs) for name, xs in all_runs.items()}
    common: dict[str, Any] = {
        "benchmark": "4. API under load",
        "smoke": smoke,
        "api_workers": api_workers,
        "concurrency": CONCURRENCY,
    }
    s, p, q = runs["submits"], runs["polls"], runs["polls_304"]
    notes = [
        f"{name}: median {x['per_s']:.0f}/s of rounds "
        + ", ".join(f"{v:.0f}" for v in x["all_per_s"])
        + f"; p99 median {x['p99_ms']:.1f} ms of "
        + ", ".join(f"{v:.1f}" for v in x["p99_all_ms"])
        + f" (the median round: p50 {x['p50_ms']:.1f} ms, max {x['max_ms']:.1f} ms, {x['requests']} requests)"
        for name, x in runs.items()
    ]
    notes.append(
        f"`dptrain api --workers {api_workers}`, {CONCURRENCY} keep-alive connections from `{generator()}` "
        "(a separate process on the same 2 cores)"
    )
    return {
        "api_submits_per_s": result(
            **common,
            compared="`POST /v1/jobs` answered 201 per second",
            unit="requests/s",
            value=s["per_s"],
            low=min(s["all_per_s"]),
            high=max(s["all_per_s"]),
            bar=SUBMITS_BAR,
            higher_is_better=True,
            p50_ms=s["p50_ms"],
            p99_ms=s["p99_ms"],
        ),
        "api_polls_per_s": result(
            **common,
            compared="`GET /v1/jobs/{id}` answered 200 per second",
            unit="requests/s",
            value=p["per_s"],
            low=min(p["all_per_s"]),
            high=max(p["all_per_s"]),
            bar=POLLS_BAR,
            higher_is_better=True,
            p50_ms=p["p50_ms"],
            p99_ms=p["p99_ms"],
        ),
        "api_poll_p99_ms": result(
            **common,
            compared="p99 latency of `GET /v1/jobs/{id}` (200)",
            unit="ms",
            value=p["p99_ms"],
            low=min(p["p99_all_ms"]),
            high=max(p["p99_all_ms"]),
            bar=P99_BAR_MS,
            higher_is_better=False,
            p50_ms=p["p50_ms"],
        ),
        "api_poll_304_per_s": result(
            **common,
            compared="`GET /v1/jobs/{id}` with `If-None-Match`, answered 304, per second",
            unit="requests/s",
            value=q["per_s"],
            low=min(q["all_per_s"]),
            high=max(q["all_per_s"]),
            bar=p["per_s"],
            higher_is_better=True,
            p50_ms=q["p50_ms"],
            p99_ms=q["p99_ms"],
            notes=notes,
        ),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """CLI entry point."""
    ap = argparse.ArgumentParser(prog="python -m bench.api_load", description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one second per run; figures mean nothing")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--api-workers", type=int, default=None, help="uvicorn processes (default 2, smoke 1)")
    args = ap.parse_args(argv)
    results = run(args.smoke, args.api_workers)
    finish(results, args.json)
    return results


if __name__ == "__main__":
    main()
