"""Fixtures of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from playwright.sync_api import Browser, sync_playwright

from tests.conftest import REDIS_URL
from tests.e2e.stack import Stack, running_stack

# The dashboard tests drive Debian's Chromium (no browser download): .ci/run installs it.
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """API + one CPU worker on Redis and a fresh PostgreSQL database, shared by a test module."""
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is required at {REDIS_URL} and could not be reached: {exc}")
    with running_stack(tmp_path_factory.mktemp("stack"), broker_url=REDIS_URL) as stack:
        yield stack


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's Chromium, headless; the test fails (never skips) without it."""
    if not CHROMIUM.exists():
        pytest.fail(f"Chromium is required at {CHROMIUM} (apt-get install chromium; .ci/run does it)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()
