"""Start latency of a job whose environment is already cached, against the same job with no environment.

    python -m bench.env_start [--smoke] [--json OUT]

One stack, as bench.start_latency runs it: `dptrain api` + one `dptrain worker` on PostgreSQL +
Redis, ranks sandboxed (DPTRAIN_SANDBOX=required), already up and idle. The worker builds job
environments from a local package index (tests/env_index.py: pypiserver on 127.0.0.1 serving
wheels built offline from tests/fixtures/env_packages), named by DPTRAIN_PIP_INDEX_URL.

A: the 2-process `mlp` job of bench.start_latency with `environment: {requirements: [dpt-beta]}`
(which pulls in dpt-alpha). Its first run builds the environment and is not timed (its latency is
in the notes); every timed run must be a cache hit, and the benchmark fails if the index served
anything during the timed rounds, so a miss is never measured as a hit. B: the same job without an
environment. Latency as bench.start_latency takes it: from just before the POST to the first answer
of `GET /v1/jobs/{id}/metrics` holding a point, each job awaited to its end before the next. A and
B alternate (ABBA) on the same worker; the ratio is taken per round.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import Result, cli, interleaved, ratio_of, result
from bench.stack import running_stack
from bench.start_latency import SPEC, job_start
from tests.env_index import BETA, running_index

BAR = 1.1
REQUIREMENTS = [BETA]
ENV_SPEC: dict[str, Any] = {**SPEC, "name": "bench-env-start", "environment": {"requirements": REQUIREMENTS}}


def run(smoke: bool = False) -> dict[str, Result]:
    """Build the environment once, then alternate cache-hit starts with plain starts."""
    rounds = 2 if smoke else 10
    with tempfile.TemporaryDirectory(prefix="dptrain-bench-env-") as tmp:
        index_dir, stack_dir = Path(tmp) / "index", Path(tmp) / "stack"
        index_dir.mkdir()
        stack_dir.mkdir()
        with (
            running_index(index_dir) as index,
            running_stack(
                stack_dir, worker=True, DPTRAIN_SANDBOX="required", DPTRAIN_PIP_INDEX_URL=index.url
            ) as stack,
            stack.client() as http,
        ):
            build_s = job_start(http, spec=ENV_SPEC, timeout=300)
            if index.requests(BETA) == 0:
                raise RuntimeError(
                    f"the first job with environment {REQUIREMENTS} started without asking the package "
                    f"index at {index.url}: this worker did not build it (DPTRAIN_PIP_INDEX_URL unread?)"
                )
            served = index.requests()
            m = interleaved(
                lambda: job_start(http, spec=ENV_SPEC),
                lambda: job_start(http),
                rounds,
                warmup=0 if smoke else 1,
            )
            if index.requests() != served:
                raise RuntimeError(
                    f"the package index served {index.requests() - served} requests during the timed "
                    "rounds: a start with a cached environment went to the index (not a cache hit)"
                )
    hit, plain = statistics.median(m["a_s"]), statistics.median(m["b_s"])
    return {
        "env_cache_hit_start_vs_plain": result(
            benchmark="3. Job start",
            compared=(
                "submit to first step's metrics visible in the API (2-rank mlp job, ranks sandboxed), "
                f"environment {REQUIREMENTS} already cached / the same job without an environment"
            ),
            unit="x (time ratio)",
            **ratio_of(m),
            bar=BAR,
            higher_is_better=False,
            smoke=smoke,
            hit_s=m["a_s"],
            plain_s=m["b_s"],
            build_s=build_s,
            notes=[
                f"environment cache hit vs none: medians {hit:.2f} s with the cached environment, "
                f"{plain:.2f} s without ({rounds} rounds, ABBA); the first start, which built the "
                f"environment from the local index, took {build_s:.2f} s (not timed in the ratio)"
            ],
        )
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """CLI entry point."""
    return cli("bench.env_start", __doc__, run, argv)


if __name__ == "__main__":
    main()
