"""Conditional GETs: an ETag that changes exactly when the answer does, and 304 when the client has it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from fastapi import Request, Response
from pydantic import BaseModel


def etag_of(body: bytes) -> str:
    """A strong ETag: the body's hash, so it changes exactly when the answer does."""
    return '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


def etag_of_version(*parts: object) -> str:
    """A strong ETag from what identifies a version of a resource (its id, its row version, ...).

    Cheaper than `etag_of`: the body need not be built to know it, so a 304 never builds it.
    """
    return etag_of("\x1f".join(map(str, parts)).encode())


def _matches(if_none_match: str, etag: str) -> bool:
    # RFC 9110: If-None-Match uses the weak comparison, and `*` matches any current representation.
    if if_none_match.strip() == "*":
        return True
    return any(tag.strip().removeprefix("W/") == etag for tag in if_none_match.split(","))


def conditional_json(request: Request, model: BaseModel) -> Response:
    """`model` as JSON with its ETag, or 304 with no body when `If-None-Match` names that ETag."""
    body = model.model_dump_json().encode()
    etag = etag_of(body)
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if_none_match = request.headers.get("if-none-match")
    if if_none_match and _matches(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    return Response(content=body, media_type="application/json", headers=headers)


def conditional(request: Request, *, etag: str, render: Callable[[], bytes]) -> Response:
    """`render()` as JSON with `etag`, or 304 with no body (and `render` never called) when it matches."""
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if_none_match = request.headers.get("if-none-match")
    if if_none_match and _matches(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    return Response(content=render(), media_type="application/json", headers=headers)
