"""The JSON of recently polled jobs, kept in each API process and dropped when PostgreSQL says a job changed.

Dashboards and scripts poll `GET /v1/jobs/{id}` far more often than a job changes. Each API process
keeps the answer it last built for a job (owner, ETag, body) and serves the next polls from it, with
no database round trip. Migration 0006 makes every UPDATE or DELETE of a job NOTIFY its id on
`dptrain_jobs` at commit; `listen` holds one connection per process that LISTENs there and drops
the job's entry when the notification arrives, so a poll sees a change as soon as it is committed
and delivered (milliseconds), not after a TTL.

Why the cache can never keep a stale answer:
- A miss reads the row, then stores it only if no notification (of any job) arrived and the
  listener did not drop out since the read began (`seq`). A change committed after the read
  notifies either before the store (nothing stored) or after it (the entry dropped).
- Without a working LISTEN (not yet connected, connection lost, a ping unanswered) the cache is
  off and empty: every poll reads the database, as if there were no cache. It clears again when the
  listener is back, since notifications sent meanwhile are lost.
- Entries also expire after `max_age` seconds, a bound for anything not foreseen here; a queued job's
  sooner (its caller's `max_age`): its queue position moves when other jobs do, unnotified.

Hand-written because no library keeps an in-process cache coherent with PostgreSQL NOTIFY; the
LISTEN itself is psycopg's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

log = logging.getLogger(__name__)

CHANNEL = "dptrain_jobs"  # the channel of migration 0006's trigger
APPLICATION_NAME = "dptrain-poll-cache"  # how the LISTEN connections show in pg_stat_activity


@dataclass(frozen=True, slots=True)
class CachedJob:
    """One job's answer as this process last built it."""

    owner_id: int
    etag: str
    body: bytes
    expires: float


class JobPollCache:
    """Job id -> its last answer, valid while the LISTEN connection is up.

    Used from the event loop only (routes and `listen`), so it needs no lock.
    """

    # Past this many entries the expired ones are dropped, and if that is not enough, all of them.
    MAX_ENTRIES = 10_000

    def __init__(self, *, max_age: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age, self.clock = max_age, clock
        self._entries: dict[str, CachedJob] = {}
        self._enabled = False
        # Bumped by every notification and every change of `enabled`: a read that began before a
        # bump may have missed what caused it, so its answer is not stored.
        self.seq = 0

    @property
    def enabled(self) -> bool:
        """Whether answers are kept (a LISTEN connection is up)."""
        return self._enabled

    def get(self, job_id: str) -> CachedJob | None:
        """The job's kept answer, if there is one and it has not expired."""
        entry = self._entries.get(job_id)
        if entry is None or entry.expires <= self.clock():
            return None
        return entry

    def accepts(self, seen_seq: int) -> bool:
        """Whether an answer read when `seq` was `seen_seq` may be stored now."""
        return self._enabled and seen_seq == self.seq

    def put(
        self,
        job_id: str,
        *,
        owner_id: int,
        etag: str,
        body: bytes,
        seen_seq: int,
        max_age: float | None = None,
    ) -> None:
        """Keep an answer read when `seq` was `seen_seq` unless anything changed; `max_age` if sooner."""
        if not self.accepts(seen_seq):
            return
        if len(self._entries) >= self.MAX_ENTRIES:
            now = self.clock()
            self._entries = {k: e for k, e in self._entries.items() if e.expires > now}
            if len(self._entries) >= self.MAX_ENTRIES:
                self._entries.clear()
        age = self.max_age if max_age is None else min(max_age, self.max_age)
        self._entries[job_id] = CachedJob(owner_id, etag, body, self.clock() + age)

    def invalidate(self, job_id: str) -> None:
        """A committed change of the job was notified: drop its answer."""
        self.seq += 1
        self._entries.pop(job_id, None)

    def enable(self) -> None:
        """LISTEN is up: start keeping answers (from empty: what was missed meanwhile is unknown)."""
        self.seq += 1
        self._entries.clear()
        self._enabled = True

    def disable(self) -> None:
        """LISTEN is down: keep nothing and serve nothing until it is back."""
        self.seq += 1
        self._entries.clear()
        self._enabled = False


async def listen(
    cache: JobPollCache, *, conninfo: str, ping_seconds: float = 2.0, retry_seconds: float = 1.0
) -> None:
    """Keep `cache` coherent with the jobs table until cancelled; it is enabled only while LISTENing.

    A connection that dies is noticed by psycopg; one that silently stops answering (a network
    partition) by the ping after `ping_seconds` without a notification, which must answer within
    `ping_seconds`. Either way the cache is off until a new connection LISTENs again.
    """
    while True:
        try:
            conn = await psycopg.AsyncConnection.connect(
                conninfo, autocommit=True, connect_timeout=10, application_name=APPLICATION_NAME
            )
            async with conn:
                await conn.execute(f"LISTEN {CHANNEL}")
                cache.enable()
                log.info("job poll cache: listening on %s", CHANNEL)
                while True:
                    async for note in conn.notifies(timeout=ping_seconds):
                        cache.invalidate(note.payload)
                    await asyncio.wait_for(conn.execute("SELECT 1"), ping_seconds)
        except asyncio.CancelledError:
            cache.disable()
            raise
        except Exception as exc:  # noqa: BLE001 - any failure: serve from the database, reconnect
            if cache.enabled:
                log.warning("job poll cache off, LISTEN connection lost: %s", exc)
            cache.disable()
            await asyncio.sleep(retry_seconds)
