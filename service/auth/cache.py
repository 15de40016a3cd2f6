"""A short-lived cache of token hash -> user in each API process, so a poll costs no user lookup.

A revocation committed in this process empties the revoked user's entries at once (every cache of
the process, via `forget_user_on_commit`); one committed elsewhere (another API process, the
`dptrain users revoke` CLI) takes effect here once the entry expires, `ttl` seconds at most after it
was looked up. Unknown tokens are never cached, so a token issued anywhere works at its first use.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Awaitable, Callable

from sqlalchemy import event
from sqlalchemy.orm import Session

from service.models import User

# Every cache of this process, so that a revocation reaches them all (tests build many apps).
_CACHES: weakref.WeakSet[TokenCache] = weakref.WeakSet()


class TokenCache:
    """Users by token hash for `ttl` seconds; `ttl` 0 caches nothing.

    The cached users are detached from any session and shared by concurrent requests: read-only.
    """

    # Past this many entries the expired ones are dropped, and if that is not enough, all of them.
    MAX_ENTRIES = 10_000

    def __init__(self, *, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._entries: dict[str, tuple[float, User]] = {}
        self._lock = threading.Lock()
        # Bumped by every forget: a lookup that started before it must not put its answer back.
        self._generation = 0
        self._flights: dict[str, asyncio.Future[User | None]] = {}
        _CACHES.add(self)

    def get(self, token_hash: str) -> User | None:
        """The cached user of a token hash, or None if absent or expired."""
        entry = self._entries.get(token_hash)
        if entry is None or entry[0] <= self.clock():
            return None
        return entry[1]

    async def user_for(self, token_hash: str, load: Callable[[], Awaitable[User | None]]) -> User | None:
        """The cached user, else `await load()` (the database), shared by every request that asks meanwhile.

        Shared because an entry expires for all clients of a token at once: under load, dozens of
        requests would otherwise look the same token up in the same millisecond.
        """
        user = self.get(token_hash)
        if user is not None:
            return user
        flight = self._flights.get(token_hash)
        if flight is None:
            flight = asyncio.ensure_future(self._load(token_hash, load, self._generation))
            self._flights[token_hash] = flight
            flight.add_done_callback(lambda f: self._landed(token_hash, f))
        # Shielded: one waiter going away (a client disconnect) must not cancel the others' lookup.
        return await asyncio.shield(flight)

    def _landed(self, token_hash: str, flight: asyncio.Future[User | None]) -> None:
        self._flights.pop(token_hash, None)
        if not flight.cancelled():
            flight.exception()  # retrieved here: every waiter may have gone (no "never retrieved")

    async def _load(
        self, token_hash: str, load: Callable[[], Awaitable[User | None]], generation: int
    ) -> User | None:
        user = await load()
        if user is not None:
            self._put(token_hash, user, generation)
        return user

    def _put(self, token_hash: str, user: User, generation: int) -> None:
        if self.ttl <= 0:
            return
        now = self.clock()
        with self._lock:
            if generation != self._generation:
                return  # a revocation landed while this was looked up: the answer may be stale
            if len(self._entries) >= self.MAX_ENTRIES:
                self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
                if len(self._entries) >= self.MAX_ENTRIES:
                    self._entries = {}
            self._entries[token_hash] = (now + self.ttl, user)

    def forget_user(self, user_id: int) -> None:
        """Drop every entry of a user (their tokens were revoked)."""
        with self._lock:
            self._generation += 1
            self._entries = {k: v for k, v in self._entries.items() if v[1].id != user_id}


def forget_user_everywhere(user_id: int) -> None:
    """Drop a user's entries from every cache of this process."""
    for cache in list(_CACHES):
        cache.forget_user(user_id)


def forget_user_on_commit(session: Session, user_id: int) -> None:
    """Once `session` commits (a revocation), drop the user's entries from every cache of this process.

    After the commit, not before: a request that looked the token up in between would otherwise
    put the still-live token back for another `ttl`.
    """
    event.listen(session, "after_commit", lambda _s: forget_user_everywhere(user_id), once=True)
