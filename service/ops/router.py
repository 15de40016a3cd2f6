"""Operations endpoints: readiness (no token) and the Prometheus scrape (an admin's or the scrape token)."""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from kombu import Connection
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.deps import SettingsDep, get_current_user
from service.errors import Forbidden, Unauthorized, error_responses
from service.ops import repository
from service.ops.metrics import Scrape
from service.strict_json import StrictJSONRoute

log = logging.getLogger(__name__)
router = APIRouter(tags=["ops"], route_class=StrictJSONRoute)

BROKER_TIMEOUT_SECONDS = 2.0


@router.get("/readyz", responses={503: {"description": "`{status: unavailable, failed: [...]}`"}})
def readyz(request: Request, settings: SettingsDep) -> JSONResponse:
    """Readiness: 200 only when the database and the broker both answer."""
    failed = []
    try:
        with request.app.state.session_factory() as session:
            repository.ping(session)
    except Exception:  # noqa: BLE001 - any failure means not ready; the reason goes to the log
        log.warning("readyz: database unreachable", exc_info=True)
        failed.append("database")
    try:
        with Connection(settings.broker_url, connect_timeout=BROKER_TIMEOUT_SECONDS) as conn:
            conn.ensure_connection(
                max_retries=1, interval_start=0, interval_step=0, timeout=BROKER_TIMEOUT_SECONDS
            )
    except Exception:  # noqa: BLE001
        log.warning("readyz: broker unreachable", exc_info=True)
        failed.append("broker")
    if failed:
        return JSONResponse({"status": "unavailable", "failed": failed}, status_code=503)
    return JSONResponse({"status": "ready"})


async def _scraper_is_admin(request: Request, settings: SettingsDep) -> bool:
    """Who scrapes: False for DPTRAIN_METRICS_TOKEN, True for an admin; 401 without a token, 403 a user."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    expected = settings.metrics_token
    # Digests compared, so that neither the bytes nor the length of the token leak through timing.
    if (
        expected is not None
        and scheme.lower() == "bearer"
        and hmac.compare_digest(_digest(token), _digest(expected.get_secret_value()))
    ):
        return False
    # Anything else is a user's token, checked (and rate-limited) as on every other route.
    user = await get_current_user(request)
    if not user.is_admin:
        raise Forbidden("GET /metrics takes an admin's token or the scrape token (DPTRAIN_METRICS_TOKEN)")
    return True


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@router.get(
    "/metrics",
    response_class=Response,
    responses=error_responses(Unauthorized, Forbidden),
)
def metrics(request: Request, admin: Annotated[bool, Depends(_scraper_is_admin)]) -> Response:
    """Prometheus text format: jobs, queue, start delays, request latency, heartbeats, ingest rate.

    For an admin's token or DPTRAIN_METRICS_TOKEN. The scrape token sees worker names as a non-admin
    does in `/v1/workers` (an alias where the name gives away its host); an admin sees them as they are.
    """
    scrape = Scrape(
        request.app.state.metrics_registry, request.app.state.database_metrics, reveal_hosts=admin
    )
    return Response(generate_latest(scrape), media_type=CONTENT_TYPE_LATEST)
