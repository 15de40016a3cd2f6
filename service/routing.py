"""How the API's routers are built, so that none forgets the strict body parser or its error responses."""

from __future__ import annotations

from fastapi import APIRouter

from service.errors import TooManyRequests, Unauthorized, error_responses
from service.strict_json import StrictJSONRoute


def v1_router(resource: str) -> APIRouter:
    """The router of `/v1/<resource>`: token-authenticated (401, 429 in OpenAPI), strict JSON bodies."""
    return APIRouter(
        prefix=f"/v1/{resource}",
        tags=[resource],
        responses=error_responses(Unauthorized, TooManyRequests),
        route_class=StrictJSONRoute,
    )
