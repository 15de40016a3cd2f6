"""Sending node starts: a publish the broker refused is tried again within seconds, never holding its caller.

In the test's process (a stand-in that fails while "the broker is down"), then against a private
`redis-server` that is stopped and started again, through Celery and kombu as the API sends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from service.config import Settings
from service.dispatch import BackgroundDispatcher, CeleryDispatcher, NodeStart, node_dispatcher, node_queue
from tests.e2e.services import PrivateRedis

A = NodeStart(job_id="job-a", attempt=1, node_rank=0, worker="n1")
B = NodeStart(job_id="job-b", attempt=1, node_rank=0, worker="n1")


class Broker:
    """A stand-in dispatcher: refuses every publish while `down`, may hold each one for `slow` seconds."""

    def __init__(self, *, down: bool = False, slow: float = 0.0) -> None:
        self.down, self.slow = down, slow
        self.sent: list[NodeStart] = []
        self.tries = 0

    def start_node(self, start: NodeStart) -> None:
        self.tries += 1
        time.sleep(self.slow)
        if self.down:
            raise ConnectionError("broker unreachable")
        self.sent.append(start)


def _until(what: Callable[[], bool], *, within: float) -> bool:
    deadline = time.monotonic() + within
    while not what() and time.monotonic() < deadline:
        time.sleep(0.02)
    return what()


class TestBackgroundDispatcher:
    def test_a_start_the_broker_refused_goes_out_soon_after_it_is_back(self) -> None:
        broker = Broker(down=True)
        sender = BackgroundDispatcher(broker, resend_seconds=0.1)
        sender.start_node(A)
        assert _until(lambda: broker.tries >= 3, within=5), f"expected repeated tries, got {broker.tries}"
        assert broker.sent == [] and sender.due() == [A]
        broker.down = False
        assert _until(lambda: broker.sent == [A], within=5), f"expected A sent once back, got {broker.sent}"
        assert sender.due() == [], "nothing is left to send"

    def test_a_publish_never_holds_the_placement_that_asked_for_it(self) -> None:
        broker = Broker(down=True, slow=2.0)  # kombu's retries against a broker that stays down
        sender = BackgroundDispatcher(broker, resend_seconds=0.1)
        began = time.monotonic()
        sender.start_node(A)
        sender.start_node(B)
        took = time.monotonic() - began
        assert took < 0.5, f"handing over two starts took {took:.1f} s: the caller waited on the broker"
        broker.down, broker.slow = False, 0.0  # lets the sender thread go idle
        assert _until(lambda: not sender.due(), within=10)

    def test_a_start_sent_again_while_still_due_goes_out_once(self) -> None:
        broker = Broker(down=True)
        sender = BackgroundDispatcher(broker, resend_seconds=0.1)
        for start in (A, B, A):  # the last one: the reconciler's republish of A, still due here
            sender.start_node(start)
        assert _until(lambda: broker.tries >= 2, within=5)
        broker.down = False
        assert _until(lambda: len(broker.sent) >= 2, within=5)
        time.sleep(0.3)
        assert sorted(s.job_id for s in broker.sent) == ["job-a", "job-b"], f"once each: {broker.sent}"

    def test_a_start_the_broker_keeps_refusing_holds_up_no_other(self) -> None:
        class RefusesA(Broker):
            refuse = True

            def start_node(self, start: NodeStart) -> None:
                if start == A and self.refuse:
                    raise ValueError("refused")
                super().start_node(start)

        broker = RefusesA()
        sender = BackgroundDispatcher(broker, resend_seconds=0.1)
        sender.start_node(A)
        sender.start_node(B)
        assert _until(lambda: broker.sent == [B], within=5), f"B must go out, got {broker.sent}"
        assert sender.due() == [A]
        broker.refuse = False  # lets the sender thread go idle
        assert _until(lambda: not sender.due(), within=5)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _settings(server: PrivateRedis, tmp_path: Path) -> Settings:
    return Settings(broker_url=server.url, queue="dispatch-test", artifact_root=tmp_path / "artifacts")


def _queued(server: PrivateRedis, worker: str) -> int:
    """How many messages wait in `worker`'s queue (kombu's Redis transport keeps a queue as a list)."""
    return int(redis.Redis.from_url(server.url).llen(node_queue("dispatch-test", worker)))


@pytest.mark.e2e
def test_a_publish_outlives_a_broker_blip_of_a_second(private_redis: PrivateRedis, tmp_path: Path) -> None:
    dispatcher = CeleryDispatcher(_settings(private_redis, tmp_path))
    dispatcher.start_node(A)  # connected, and its queue declared
    private_redis.stop()
    threading.Timer(1.0, private_redis.start).start()
    dispatcher.start_node(B)  # kombu's retry policy: reconnects and publishes once the broker is back
    assert _until(lambda: _queued(private_redis, "n1") == 1, within=10), "B must be in n1's queue"


@pytest.mark.e2e
def test_a_start_placed_while_the_broker_is_down_reaches_its_queue_after_its_return(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    dispatcher = node_dispatcher(_settings(private_redis, tmp_path))
    private_redis.stop()
    began = time.monotonic()
    dispatcher.start_node(A)
    assert time.monotonic() - began < 0.5, "the placement round must not wait on the broker"
    time.sleep(5)  # kombu's retries are spent: A waits in the process for the next try
    private_redis.start()
    back = time.monotonic()
    assert _until(lambda: _queued(private_redis, "n1") == 1, within=15), (
        f"A was not in n1's queue {time.monotonic() - back:.0f} s after the broker came back"
    )
