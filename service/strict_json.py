"""Request bodies are read as strict JSON: what JSON cannot carry, or the database cannot store, is a 422.

Python's `json` reads `NaN`, `Infinity` and numbers beyond a float's range (`1e999` becomes inf), nests
as deep as the interpreter's stack allows (a RecursionError past that), and keeps `\\u0000` in
strings, which PostgreSQL refuses in text and JSONB. Every route of ours is a `StrictJSONRoute`, so
its body is read by `loads` instead, in this one place, before any model sees it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

# Far more than any spec needs (a few levels, extras included), far less than the interpreter's stack.
MAX_DEPTH = 32
NOT_JSON_TEXT = "body is not valid JSON text"
STRING_NUL, NUL_MESSAGE = "string_nul", "Strings may not contain NUL (\\u0000)"
_TOO_DEEP = f"JSON nested too deeply: more than {MAX_DEPTH} levels of arrays and objects"


class _NotFinite(str):
    """Stands in, during parsing, for a number that is not finite: the literal as the client wrote it."""


def loads(body: bytes) -> Any:
    """The JSON value of a body; a RequestValidationError naming the field path for what it refuses."""
    refused: list[str] = []

    def constant(literal: str) -> _NotFinite:
        refused.append(literal)
        return _NotFinite(literal)

    def real(literal: str) -> float | _NotFinite:
        value = float(literal)
        return value if math.isfinite(value) else constant(literal)

    try:
        value = json.loads(body, parse_constant=constant, parse_float=real)
    except json.JSONDecodeError as exc:
        # The entry FastAPI itself answers for a syntax error.
        raise _invalid(("body", exc.pos), "JSON decode error", ctx={"error": exc.msg}) from exc
    except RecursionError as exc:
        raise _invalid(("body",), _TOO_DEEP) from exc
    except ValueError as exc:  # not UTF-8 (UnicodeDecodeError), an integer of more than 4300 digits
        raise _invalid(("body",), NOT_JSON_TEXT, ctx={"error": str(exc)}) from exc
    # Walking the value costs more than parsing it; only a body that may hold something to refuse is walked.
    if refused or b"\\u0000" in body or body.count(b"[") + body.count(b"{") > MAX_DEPTH:
        errors = _refusals(value)
        if errors:
            raise RequestValidationError(errors)
    return value


def _invalid(
    loc: tuple[str | int, ...], msg: str, *, ctx: dict[str, str] | None = None
) -> RequestValidationError:
    entry: dict[str, Any] = {"type": "json_invalid", "loc": loc, "msg": msg}
    if ctx:
        entry["ctx"] = ctx
    return RequestValidationError([entry])


def _refusals(value: Any, *, limit: int = 20) -> list[dict[str, Any]]:
    """Entries for every non-finite number, NUL in a string, and container too deep, in document order."""
    errors: list[dict[str, Any]] = []
    # Iterative: a value nested as deep as the parser allowed must not recurse here.
    stack: list[tuple[tuple[str | int, ...], Any]] = [(("body",), value)]
    while stack and len(errors) < limit:
        loc, item = stack.pop()
        if isinstance(item, dict | list):
            if len(loc) > MAX_DEPTH:
                errors.append({"type": "json_invalid", "loc": loc, "msg": _TOO_DEEP})
                continue
            pairs = list(item.items()) if isinstance(item, dict) else list(enumerate(item))
            for key, child in reversed(pairs):
                if isinstance(key, str) and "\x00" in key:
                    errors.append(_nul(loc + (key,), key))
                stack.append((loc + (key,), child))
        elif isinstance(item, _NotFinite):
            errors.append(
                {
                    "type": "finite_number",
                    "loc": loc,
                    "msg": "Input should be a finite number",
                    "input": str(item),
                }
            )
        elif isinstance(item, str) and "\x00" in item:
            errors.append(_nul(loc, item))
    return errors


def _nul(loc: tuple[str | int, ...], text: str) -> dict[str, Any]:
    # PostgreSQL stores no NUL in text or JSONB: refused here rather than failing the INSERT.
    return {"type": STRING_NUL, "loc": loc, "msg": NUL_MESSAGE, "input": text}


def _is_json(content_type: str | None) -> bool:
    # FastAPI's own rule: application/json or application/*+json (no Content-Type: not parsed as JSON).
    media = (content_type or "").partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class StrictJSONRequest(Request):
    """A request whose `json()` is `loads`: FastAPI reads a JSON body with `await request.json()`."""

    async def json(self) -> Any:
        """The body, parsed once by `loads`."""
        if not hasattr(self, "_strict_json"):
            self._strict_json = loads(await self.body())
        return self._strict_json


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is parsed by `loads` and refused with a 422 naming what was wrong."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler, given a `StrictJSONRequest` whose body is parsed before it runs."""
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def strict(request: Request) -> Response:
            request = StrictJSONRequest(request.scope, request.receive)
            if _is_json(request.headers.get("content-type")) and await request.body():
                # Parsed here, outside FastAPI's own parse: it would answer any error of `json()`,
                # a RequestValidationError included, with a bare 400.
                await request.json()
            return await handler(request)

        return strict
