"""A small error hierarchy with one handler: `{"error": <ClassName>, "detail": <message>}`."""

from __future__ import annotations

import enum
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from service.strict_json import NOT_JSON_TEXT

_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
# Levels of a refused input echoed back in a 422; deeper ones are cut (the field path says where).
_ECHO_DEPTH = 8


class ServiceError(Exception):
    """Base of every error the API answers on purpose."""

    status_code = 500

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers


class NotFound(ServiceError):
    status_code = 404


class Conflict(ServiceError):
    status_code = 409


class InvalidTransition(Conflict):
    """The job is not in a state that allows this."""


class Unauthorized(ServiceError):
    status_code = 401

    def __init__(self, message: str = "missing or invalid bearer token") -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ServiceError):
    status_code = 403


class PayloadTooLarge(ServiceError):
    status_code = 413


class TooManyRequests(ServiceError):
    status_code = 429

    def __init__(self, message: str, *, retry_after: float) -> None:
        # Retry-After is whole seconds (RFC 9110); round up so a client that obeys it is let in.
        super().__init__(message, headers={"Retry-After": str(max(1, math.ceil(retry_after)))})


def invalid_field(loc: tuple[str | int, ...], msg: str, value: object) -> RequestValidationError:
    """A 422 naming the field at `loc` (e.g. `("body", "code", "sha256")`), as FastAPI's own are."""
    return RequestValidationError([{"type": "value_error", "loc": loc, "msg": msg, "input": value}])


def error_responses(*errors: type[ServiceError]) -> dict[int | str, dict[str, object]]:
    """OpenAPI `responses=` entries for the errors a route may answer."""
    from api_schemas import ErrorBody

    return {e.status_code: {"model": ErrorBody, "description": e.__name__} for e in errors}


def install_error_handler(app: FastAPI) -> None:
    """Register the one handler that turns ServiceError into its JSON answer."""

    @app.exception_handler(ServiceError)
    async def _handle(_request: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse(
            {"error": type(exc).__name__, "detail": text(exc.message)},
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler fails (a 500, and the connection dropped) on an entry JSON cannot
        # carry: a NaN or infinite input or bound, bytes, an exception in `ctx`.
        return JSONResponse({"detail": [jsonable(e) for e in exc.errors()]}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            # Starlette's Allow names only the first route of the path; GET and POST /v1/jobs (or
            # POST and DELETE .../tokens) are separate routes, so ask every route for every method.
            exc.headers = {**(exc.headers or {}), "Allow": ", ".join(_allowed(request))}
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # A body that is not even text (bad UTF-8): the same 422 as any other malformed JSON.
            detail = [{"type": "json_invalid", "loc": ["body"], "msg": NOT_JSON_TEXT}]
            return JSONResponse({"detail": detail}, status_code=422)
        return await http_exception_handler(request, exc)


def jsonable(value: Any, *, depth: int = 0) -> Any:
    """`value` as strict JSON can carry it: non-finite floats as "NaN" or "Infinity", odd objects as text.

    Text is escaped where UTF-8 cannot carry it (`text`), keys too: a 422 echoes what was sent.
    """
    if isinstance(value, str):
        return text(value)
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, enum.Enum):
        return jsonable(value.value, depth=depth)
    if isinstance(value, dict | list | tuple | set | frozenset) and depth >= _ECHO_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {text(str(k)): jsonable(v, depth=depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v, depth=depth + 1) for v in value]
    return text(str(value))


def text(value: str) -> str:
    """`value` as UTF-8 can carry it: a lone surrogate (JSON's `"\\ud800"`) written as `\\ud800`."""
    # ASCII first: the common case, and no copy. Any other character but a surrogate encodes as is.
    if value.isascii():
        return value
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _allowed(request: Request) -> list[str]:
    routes = request.app.router.routes
    return [
        m for m in _METHODS if any(r.matches({**request.scope, "method": m})[0] is Match.FULL for r in routes)
    ]
