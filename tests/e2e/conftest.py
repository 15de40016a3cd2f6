"""Fixtures of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.conftest import REDIS_URL
from tests.e2e.stack import Stack, running_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """API + one CPU worker on Redis and a fresh PostgreSQL database, shared by a test module."""
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is required at {REDIS_URL} and could not be reached: {exc}")
    with running_stack(tmp_path_factory.mktemp("stack"), broker_url=REDIS_URL) as stack:
        yield stack
