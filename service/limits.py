"""Request limits: a body-size cap (413), rate limits per user and per address on unknown tokens (429)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class TokenBuckets:
    """One token bucket per key (a user, a token, a client address) in this process: `rate`/s, up to `burst`.

    In-process on purpose: no round trip per request. Several API processes each keep their own
    buckets, so the effective limit is per process (docs/api.md says so).
    """

    # Past this many keys, full (idle) buckets are forgotten: a full bucket is the same as none.
    MAX_KEYS = 10_000

    def __init__(self, *, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, float(burst), clock
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str) -> float | None:
        """Spend one token of `key`'s bucket; None if allowed, else the seconds until one is there."""
        if self.rate <= 0:
            return None
        with self._lock:
            level, now = self._level(key)
            if level < 1.0:
                self._buckets[key] = (level, now)
                return (1.0 - level) / self.rate
            self._store(key, level - 1.0, now)
            return None

    def waiting(self, key: str) -> float | None:
        """Seconds until `key`'s bucket holds a token, None if it holds one now; spends nothing."""
        if self.rate <= 0:
            return None
        with self._lock:
            level, _ = self._level(key)
        return None if level >= 1.0 else (1.0 - level) / self.rate

    def spend(self, key: str) -> None:
        """Spend one token of `key`'s bucket for something already done (an empty bucket stays empty)."""
        if self.rate <= 0:
            return
        with self._lock:
            level, now = self._level(key)
            self._store(key, max(0.0, level - 1.0), now)

    def _level(self, key: str) -> tuple[float, float]:
        """`key`'s tokens now (refilled since its last use), and now; under the lock."""
        now = self.clock()
        level, then = self._buckets.get(key, (self.burst, now))
        return min(self.burst, level + (now - then) * self.rate), now

    def _store(self, key: str, level: float, now: float) -> None:
        self._buckets[key] = (level, now)
        if len(self._buckets) > self.MAX_KEYS:
            self._forget_idle(now)

    def _forget_idle(self, now: float) -> None:
        idle = [k for k, (lv, t) in self._buckets.items() if lv + (now - t) * self.rate >= self.burst]
        for k in idle:
            del self._buckets[k]


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` answers 413 before the app sees any of it.

    It counts the bytes actually received (a chunked body has no Content-Length, and a client can
    lie in it), buffering at most `max_bytes`; a declared Content-Length over the cap is refused at once.
    Paths under `streamed` pass untouched: their routes stream the body and enforce their own cap.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, streamed: tuple[str, ...] = ()) -> None:
        self.app, self.max_bytes, self.streamed = app, max_bytes, streamed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self.streamed):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._refuse(send)
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            # After the body, what the app waits for is the disconnect (a streaming response does).
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {"error": "PayloadTooLarge", "detail": f"request body exceeds {self.max_bytes} bytes"}
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        # The rest of the body is not read: close the connection rather than leave it half-read.
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
