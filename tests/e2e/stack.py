"""A production-shaped stack for end-to-end tests: `dptrain api` + `dptrain worker` on PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.api_fixtures import ADMIN_TOKEN
from tests.conftest import create_database, drop_database, free_port
from tests.e2e.helpers import Procs, service_env, wait_healthy


@dataclass
class Stack:
    http: httpx.Client
    procs: Procs
    db_url: str
    env: dict[str, str] = field(default_factory=dict)

    def start_worker(self, name: str) -> None:
        """Start another `dptrain worker` node, named `name`, on the same database and broker."""
        self.procs.start(name, ["worker", "--device", "cpu", "--node-name", name], self.env)


@contextmanager
def running_stack(
    tmp: Path, *, broker_url: str, db_url: str | None = None, **extra_env: str
) -> Iterator[Stack]:
    """Start API and one CPU worker on a fresh database and a queue of this stack's own.

    `db_url`: a migrated database to use (a private server's) instead of a fresh one on the shared
    server; `extra_env` adds or overrides DPTRAIN_* settings of both processes.
    """
    own_db = db_url is None
    db_url = db_url or create_database("dptrain_e2e")
    env = service_env(
        tmp,
        db_url=db_url,
        broker_url=broker_url,
        # A queue of this run's own, so parallel runs on one broker never take each other's jobs.
        queue=f"dptrain-e2e-{uuid.uuid4().hex[:8]}",
        **{
            # Short, so the lost-publish test does not wait ten minutes.
            "DPTRAIN_REPUBLISH_AFTER_SECONDS": "3",
            "DPTRAIN_RECONCILE_INTERVAL_SECONDS": "1",
            **extra_env,
        },
    )
    procs = Procs(tmp)
    port = free_port()
    procs.start("api", ["api", "--port", str(port)], env)
    procs.start("worker", ["worker", "--device", "cpu", "--node-name", "worker"], env)
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    try:
        wait_healthy(base, procs)
        yield Stack(http, procs, db_url, env)
    finally:
        http.close()
        procs.stop()
        if own_db:
            drop_database(db_url)
