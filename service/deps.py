"""Request dependencies as Annotated aliases; routes just declare them."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import Depends, Request
from fastapi.security import HTTPBearer
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service.auth.cache import TokenCache
from service.auth.tokens import hash_token
from service.config import Settings
from service.db import autocommit_reader
from service.errors import TooManyRequests, Unauthorized
from service.limits import TokenBuckets
from service.models import User
from service.scheduling.scheduler import Kicker
from service.users.repository import user_for_token_hash

log = logging.getLogger(__name__)
T = TypeVar("T")
# Where `_owned` leaves the limiter of `run_in_transaction` for the session it opens.
_DB_LIMITER = "dptrain.db_limiter"


# Dependencies that do no I/O are `async def`: FastAPI runs a sync one in the threadpool, a hop that
# costs more under load than the function itself.


async def get_settings_dep(request: Request) -> Settings:
    """The app's settings."""
    settings: Settings = request.app.state.settings
    return settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session whose transaction the request owns: commit at the end, rollback on error.

    Callbacks queued in `session.info["after_commit"]` (kicking placement) run only after the
    commit succeeded, so placement never looks for a job whose row is not there yet.
    """
    async with _owned(request, request.app.state.session_factory()) as session:
        yield session


@asynccontextmanager
async def _owned(request: Request, session: Session) -> AsyncIterator[Session]:
    # Async, so that opening costs no threadpool hop (making a Session does no I/O); the commit and
    # a rollback do I/O, so they run in a worker thread, one hop, and only when there is a
    # transaction left (`run_in_transaction` commits its own; a request answered from the token
    # cache without a query has none).
    # Each hop takes a token of a limiter that guards threads; a thread that waits for a pooled
    # connection must never hold the token a connection holder waits for, else a full pool
    # deadlocks. So: commits (which hold their connection) have a limiter of their own and never
    # wait for the pool; `run_in_transaction` hops (which hold none while they wait for a token)
    # have another, as large as the pool, so they do not wait for it either.
    session.info[_DB_LIMITER] = request.app.state.db_limiter
    commits: anyio.CapacityLimiter = request.app.state.commit_limiter
    try:
        yield session
        if session.in_transaction() or session.info.get("after_commit"):
            await anyio.to_thread.run_sync(_commit, session, limiter=commits)
        else:
            session.close()
    except BaseException:
        # Shielded: a client that went away cancels the request, and the connection must still
        # go back to the pool rolled back.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(session.close, limiter=commits)
        raise


async def run_in_transaction(session: Session, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`fn(session, *args, **kwargs)`, then the commit (and after-commit callbacks), in one worker thread.

    For async routes on hot paths: the request's whole unit of work in one threadpool hop, and its
    connection back in the pool before the answer is built. `get_session` then finds no
    transaction left to commit; if `fn` raises, it rolls back as for any route.
    """

    def work() -> T:
        result = fn(session, *args, **kwargs)
        _commit(session)
        return result

    # At most as many at once as the pool has connections: more would only wait in the pool, or
    # open overflow connections that are closed again at once (a PostgreSQL backend per request).
    return await anyio.to_thread.run_sync(work, limiter=session.info[_DB_LIMITER])


async def run_read(request: Request, fn: Callable[..., T], /, **kwargs: Any) -> T:
    """`fn(session, **kwargs)` on a read-only session of its own, opened and closed in one worker thread.

    For async routes that read only sometimes (a poll the job cache cannot answer): no session
    dependency to solve on the requests that need none. Each statement commits on its own
    (`autocommit_reader`).
    """
    sessions = autocommit_reader(request.app.state.session_factory)

    def work() -> T:
        with sessions() as session:
            return fn(session, **kwargs)

    return await anyio.to_thread.run_sync(work, limiter=request.app.state.db_limiter)


def _commit(session: Session) -> None:
    try:
        session.commit()
        callbacks: list[Callable[[], None]] = session.info.pop("after_commit", [])
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001
                # The job row is committed, so the submit still succeeds: the next periodic
                # placement round finds the queued job anyway.
                log.exception("after-commit callback failed")
    finally:
        session.close()  # after a commit it only hands the connection back; after a failure, rolls back


async def get_scheduler(request: Request) -> Kicker:
    """The placement thread of this API process, kicked when a job is submitted."""
    scheduler: Kicker = request.app.state.scheduler
    return scheduler


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
# scope="function": commit (and kick placement) before the response is sent, so a 201 means committed.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SchedulerDep = Annotated[Kicker, Depends(get_scheduler)]


class BearerUser(HTTPBearer):
    """The user of the request's bearer token, or 401; 429 once the user spent their rate limit.

    Looked up in the process's token cache first (`DPTRAIN_AUTH_CACHE_SECONDS`), in the database
    only on a miss; the cached user is detached and read-only.

    An `HTTPBearer` itself (so OpenAPI still shows the bearer scheme) rather than a function that
    depends on one: every request authenticates, and FastAPI solves each dependency level anew
    per request, and a cached poll is mostly that work.
    """

    def __init__(self) -> None:
        super().__init__(auto_error=False)

    async def __call__(self, request: Request) -> User:  # type: ignore[override]
        """Authenticate the request."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized()
        digest = hash_token(token)
        limiter: TokenBuckets = request.app.state.rate_limiter
        cache: TokenCache = request.app.state.token_cache
        user = cache.get(digest)
        if user is None:
            # A token the cache does not hold is counted on a bucket of its own before the lookup,
            # so a flood with one (even invalid) token costs no database work.
            wait = limiter.take(f"token:{digest}")
            if wait is not None:
                raise TooManyRequests("rate limit of this token exceeded", retry_after=wait)
            user = await _looked_up(request, digest)
        # Keyed by user, not token: a user may mint tokens, and each would otherwise bring a fresh burst.
        wait = limiter.take(f"user:{user.id}")
        if wait is not None:
            raise TooManyRequests(
                "rate limit of this user exceeded (all of a user's tokens share it)", retry_after=wait
            )
        return user


get_current_user = BearerUser()


async def _looked_up(request: Request, digest: str) -> User:
    """The user of a token the cache does not hold, or 401; 429 once its address tried too many."""
    # A flood of distinct tokens brings a fresh per-token bucket each: the client's address pays
    # for every lookup before it is made, and gets its try back if the token was valid, so only
    # invalid tokens spend it (DPTRAIN_AUTH_FAILURES_PER_SECOND).
    failures: TokenBuckets = request.app.state.auth_failure_limiter
    address = f"address:{request.client.host if request.client else 'unknown'}"
    wait = failures.take(address)
    if wait is not None:
        raise TooManyRequests("too many unknown bearer tokens from this address", retry_after=wait)
    user = await _cached_user(request, digest)
    if user is None:
        raise Unauthorized()
    failures.refund(address)
    return user


async def _cached_user(request: Request, digest: str) -> User | None:
    cache: TokenCache = request.app.state.token_cache
    sessions = request.app.state.session_factory
    return await cache.user_for(digest, lambda: run_in_threadpool(_lookup, sessions, digest))


def _lookup(sessions: sessionmaker[Session], digest: str) -> User | None:
    # A session of its own, closed at once: the request's session would keep its connection
    # until the request's commit, across threadpool hops.
    with sessions() as session:
        user = user_for_token_hash(session, token_hash=digest)
        if user is not None:
            # Detached, so that nothing done to a session expires what other requests read.
            session.expunge(user)
        return user


CurrentUser = Annotated[User, Depends(get_current_user)]


def token_check(request: Request) -> Callable[[], Awaitable[bool]]:
    """Whether the request's bearer token is still live, asked again later (an open event stream).

    Through the token cache, so it is as fresh as any request's check (`DPTRAIN_AUTH_CACHE_SECONDS`)
    and costs at most one lookup per token per cache period however many streams ask.
    """
    digest = hash_token(request.headers.get("authorization", "").partition(" ")[2])

    async def live() -> bool:
        return await _cached_user(request, digest) is not None

    return live


def after_commit(session: Session, callback: Callable[[], None]) -> None:
    """Run `callback` once this request's transaction has committed."""
    session.info.setdefault("after_commit", []).append(callback)
