"""End to end on the production components: API + Celery worker over Redis, PostgreSQL, real ranks."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis

from tests.api_fixtures import ADMIN_TOKEN
from tests.conftest import REDIS_URL, create_database, drop_database
from tests.e2e.helpers import Procs, clean_env, free_port, wait_healthy
from tests.e2e.scenario import run_mlp_scenario


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Procs]]:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is required at {REDIS_URL} and could not be reached: {exc}")
    tmp = tmp_path_factory.mktemp("stack")
    db_url = create_database("dptrain_e2e")
    env = clean_env(
        DPTRAIN_DATABASE_URL=db_url,
        DPTRAIN_BROKER_URL=REDIS_URL,
        # A queue of this run's own, so parallel runs on one Redis never take each other's jobs.
        DPTRAIN_QUEUE=f"dptrain-e2e-{uuid.uuid4().hex[:8]}",
        DPTRAIN_ARTIFACT_ROOT=str(tmp / "artifacts"),
        DPTRAIN_HOME=str(tmp / "home"),
        DPTRAIN_BOOTSTRAP_TOKEN=ADMIN_TOKEN,
        DPTRAIN_REPORT_INTERVAL_SECONDS="0.2",
    )
    procs = Procs(tmp)
    port = free_port()
    procs.start("api", ["api", "--port", str(port)], env)
    procs.start("worker", ["worker", "--device", "cpu"], env)
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    try:
        wait_healthy(base, procs)
        yield http, procs
    finally:
        http.close()
        procs.stop()
        drop_database(db_url)


def test_mlp_on_two_ranks_through_redis_and_postgres(stack: tuple[httpx.Client, Procs]) -> None:
    http, procs = stack
    run_mlp_scenario(http, procs)
