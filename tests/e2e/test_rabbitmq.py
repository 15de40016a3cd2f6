"""RabbitMQ is accepted as the broker too: the same scenario over AMQP."""

from __future__ import annotations

import os
from pathlib import Path

import kombu
import pytest

from tests.e2e.scenario import run_mlp_scenario
from tests.e2e.stack import running_stack

pytestmark = pytest.mark.e2e

AMQP_URL = os.environ.get("DPTRAIN_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def test_mlp_through_rabbitmq(tmp_path: Path) -> None:
    try:
        with kombu.Connection(AMQP_URL, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"RabbitMQ is required at {AMQP_URL} and could not be reached: {exc}")
    with running_stack(tmp_path, broker_url=AMQP_URL) as stack:
        run_mlp_scenario(stack.http, stack.procs)
