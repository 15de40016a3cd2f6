"""The FastAPI application."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import make_url

from service.auth.cache import TokenCache
from service.auth.tokens import ensure_bootstrap_admin
from service.code.router import router as code_router
from service.config import Settings, get_settings
from service.dashboard.router import install_dashboard
from service.db import session_factory
from service.dispatch import Dispatcher, node_dispatcher
from service.errors import install_error_handler
from service.headers import SecurityHeaders
from service.jobs.artifacts_router import router as artifacts_router
from service.jobs.poll_cache import JobPollCache, listen
from service.jobs.router import router as jobs_router
from service.jobs.stacks_router import router as stacks_router
from service.limits import BodyLimit, TokenBuckets
from service.nodes.router import router as nodes_router
from service.ops.metrics import DatabaseCollector, RequestLatency, request_histogram
from service.ops.router import router as ops_router
from service.scheduling.scheduler import Kicker, Scheduler
from service.sweeps.router import router as sweeps_router
from service.users.router import router as users_router
from service.webhooks.router import router as webhooks_router

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None, *, dispatcher: Dispatcher | None = None, scheduler: Kicker | None = None
) -> FastAPI:
    """Build the API app; tests pass their own settings, and a scheduler stand-in or a dispatcher."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.bootstrap_token is not None:
            with app.state.session_factory.begin() as session:
                ensure_bootstrap_admin(session, token=settings.bootstrap_token.get_secret_value())
        own = app.state.scheduler if isinstance(app.state.scheduler, Scheduler) else None
        if own is not None:
            own.start()
        listener = None
        if settings.poll_cache and make_url(settings.database_url).get_backend_name() == "postgresql":
            conninfo = make_url(settings.database_url).set(drivername="postgresql")
            listener = asyncio.create_task(
                listen(app.state.poll_cache, conninfo=conninfo.render_as_string(hide_password=False))
            )
        try:
            yield
        finally:
            if listener is not None:
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener
            if own is not None:
                own.stop()

    app = FastAPI(
        title="dptrain",
        version="1",
        summary="Submit data-parallel training jobs, follow them, fetch their checkpoints.",
        lifespan=lifespan,
        docs_url="/docs" if settings.api_docs else None,
        redoc_url="/redoc" if settings.api_docs else None,
    )
    app.state.settings = settings
    app.state.session_factory = session_factory(settings)
    # Placement runs in this process too, so a submitted job starts without waiting for a worker's
    # periodic round; row locks keep concurrent placements (other API processes, workers) apart.
    app.state.scheduler = scheduler or Scheduler(
        sessions=app.state.session_factory,
        dispatcher=dispatcher or node_dispatcher(settings),
        settings=settings,
    )
    install_error_handler(app)
    # A registry per app, not prometheus_client's global one: tests build many apps in one process.
    app.state.metrics_registry = CollectorRegistry()
    app.state.database_metrics = DatabaseCollector(lambda: app.state.session_factory())
    app.state.token_cache = TokenCache(ttl=settings.auth_cache_seconds)
    # Off (and empty) until the lifespan's LISTEN connection is up; stays off without PostgreSQL.
    app.state.poll_cache = JobPollCache()
    # Worker threads for database work besides anyio's default 40 (sync routes): see service.deps.
    app.state.db_limiter = anyio.CapacityLimiter(settings.db_pool_size)
    app.state.commit_limiter = anyio.CapacityLimiter(settings.db_pool_size)
    app.state.rate_limiter = TokenBuckets(
        rate=settings.rate_limit_per_second, burst=settings.rate_limit_burst
    )
    app.state.auth_failure_limiter = TokenBuckets(
        rate=settings.auth_failures_per_second, burst=settings.auth_failure_burst
    )
    # Added before RequestLatency, so it runs inside it (the last added is outermost): 413s are measured.
    # Code archives stream to disk under their own cap (DPTRAIN_CODE_MAX_BYTES), never buffered here.
    streamed = (f"{code_router.prefix}/",)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_body_bytes, streamed=streamed)
    app.add_middleware(RequestLatency, histogram=request_histogram(app.state.metrics_registry))
    # Outermost: the 413s, 429s and 401s answered by the layers inside get the headers too.
    docs_paths = frozenset(p for p in (app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url) if p)
    app.add_middleware(SecurityHeaders, docs_paths=docs_paths)
    app.include_router(jobs_router)
    app.include_router(artifacts_router)
    app.include_router(stacks_router)
    app.include_router(users_router)
    app.include_router(nodes_router)
    app.include_router(ops_router)
    app.include_router(code_router)
    app.include_router(webhooks_router)
    app.include_router(sweeps_router)
    install_dashboard(app)

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    return app
