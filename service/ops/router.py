"""Operations endpoints without a token: readiness and the Prometheus scrape."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from kombu import Connection
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.deps import SettingsDep
from service.ops import repository
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


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus text format: jobs, queue, start delays, request latency, heartbeats, ingest rate."""
    return Response(generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
