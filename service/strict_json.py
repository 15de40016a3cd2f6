"""Request bodies are read as strict JSON: what would break below the models, or the database, is a 422.

Python's `json` nests as deep as the interpreter's stack allows (a RecursionError past that, and a
body just short of it parses, then fails to render its own validation error), and keeps `\\u0000`
in strings, which PostgreSQL refuses in text and JSONB, and lone surrogates (`\\ud800`), which no
UTF-8 encoder takes (the database's, or the answer's that echoes them). Every route of ours is a
`StrictJSONRoute`, so its body is read by `loads` instead, in this one place, before any model sees
it. Non-finite numbers (`NaN`, `Infinity`, `1e999`) are left to the models
(`api_schemas.base.Strict`), which refuse them with the field's path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from api_schemas.base import MAX_JSON_DEPTH

# Twice what a spec's free-form values may nest: anything the models can judge reaches them, and
# gets their message; far less than the interpreter's stack.
MAX_DEPTH = 2 * MAX_JSON_DEPTH
NOT_JSON_TEXT = "body is not valid JSON text"
STRING_NUL, NUL_MESSAGE = "string_nul", "Strings may not contain NUL (\\u0000)"
STRING_SURROGATE = "string_surrogate"
SURROGATE_MESSAGE = "Strings may not contain a lone surrogate (\\ud800-\\udfff without its pair)"
# `\uD800`..`\uDFFF` in the text: a surrogate escape, paired (one character once parsed) or not.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_TOO_DEEP = f"JSON nested too deeply: more than {MAX_DEPTH} levels of arrays and objects"


def loads(body: bytes) -> Any:
    """The JSON value of a body; a RequestValidationError naming the field path for what it refuses."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        # The entry FastAPI itself answers for a syntax error.
        raise _invalid(("body", exc.pos), "JSON decode error", ctx={"error": exc.msg}) from exc
    except RecursionError as exc:
        raise _invalid(("body",), _TOO_DEEP) from exc
    except ValueError as exc:  # not UTF-8 (UnicodeDecodeError), an integer of more than 4300 digits
        raise _invalid(("body",), NOT_JSON_TEXT, ctx={"error": str(exc)}) from exc
    # Walking the value costs more than parsing it; only a body that may hold something to refuse is walked.
    nested = body.count(b"[") + body.count(b"{") > MAX_DEPTH
    if b"\\u0000" in body or _SURROGATE_ESCAPE.search(body) or nested:
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
    """Entries for every NUL or lone surrogate in a string or key and every container too deep, in order."""
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
                if isinstance(key, str) and (error := _bad_text(loc + (key,), key)) is not None:
                    errors.append(error)
                stack.append((loc + (key,), child))
        elif isinstance(item, str) and (error := _bad_text(loc, item)) is not None:
            errors.append(error)
    return errors


def _bad_text(loc: tuple[str | int, ...], text: str) -> dict[str, Any] | None:
    if "\x00" in text:
        # PostgreSQL stores no NUL in text or JSONB: refused here rather than failing the INSERT.
        return {"type": STRING_NUL, "loc": loc, "msg": NUL_MESSAGE, "input": text}
    if _SURROGATE.search(text) is not None:
        # JSON's `\ud800` parses to a Python str that no UTF-8 encoder takes: not the database, not
        # the answer echoing it back (the error handler escapes it).
        return {"type": STRING_SURROGATE, "loc": loc, "msg": SURROGATE_MESSAGE, "input": text}
    return None


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


def parsed_body(request: Request) -> Any:
    """The JSON body a `StrictJSONRoute` parsed before its dependencies ran, or None (none, or not JSON)."""
    return getattr(request, "_strict_json", None)


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
