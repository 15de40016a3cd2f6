"""A loopback stack for benchmarks: `dptrain api` (and a `dptrain worker`) on PostgreSQL + Redis."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import BENCH_TOKEN, REDIS_URL, ROOT, bench_env, scratch_database


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Stack:
    """What a benchmark needs to talk to the stack."""

    base_url: str
    db_url: str
    queue: str
    log_dir: Path

    def client(self) -> httpx.Client:
        """An admin client of the API."""
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {BENCH_TOKEN}"}, timeout=30
        )


@contextmanager
def running_stack(tmp: Path, *, worker: bool, api_workers: int = 1, **extra_env: str) -> Iterator[Stack]:
    """Start the API (and a CPU worker) on a fresh database and a queue of its own; stop them after."""
    procs: list[subprocess.Popen[bytes]] = []
    queue = f"dptrain-bench-{uuid.uuid4().hex[:8]}"
    with scratch_database("dptrain_bench_stack") as db_url:
        env = bench_env(
            DPTRAIN_DATABASE_URL=db_url,
            DPTRAIN_BROKER_URL=REDIS_URL,
            DPTRAIN_QUEUE=queue,
            DPTRAIN_ARTIFACT_ROOT=str(tmp / "artifacts"),
            DPTRAIN_HOME=str(tmp / "home"),
            DPTRAIN_BOOTSTRAP_TOKEN=BENCH_TOKEN,
            OMP_NUM_THREADS="1",
            # The benchmark clients poll and submit faster than one token's default 20/s allows.
            DPTRAIN_RATE_LIMIT_PER_SECOND="0",
            # api_load queues thousands of jobs as one user; the queued cap would refuse all but 100.
            DPTRAIN_MAX_QUEUED_PER_USER="0",
            **extra_env,
        )
        port = free_port()

        def start(name: str, args: list[str]) -> None:
            log = (tmp / f"{name}.log").open("ab")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "dptrain_cli.main", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=ROOT,
                    start_new_session=True,  # so stopping it takes its children (torchrun, ranks) too
                )
            )

        start("api", ["api", "--port", str(port), "--workers", str(api_workers)])
        if worker:
            start("worker", ["worker", "--device", "cpu"])
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(base, procs, tmp)
            yield Stack(base, db_url, queue, tmp)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 15)
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
                    p.wait(timeout=10)


def _wait_healthy(
    base: str, procs: list[subprocess.Popen[bytes]], log_dir: Path, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                logs = "\n".join(f.read_text(errors="replace")[-3000:] for f in log_dir.glob("*.log"))
                raise RuntimeError(f"a stack process exited with {p.returncode}:\n{logs}")
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"API at {base} not healthy after {timeout} s")
