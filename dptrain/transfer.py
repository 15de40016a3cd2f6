"""The client's HTTP plumbing: a response's typed error, Retry-After, files streamed both ways.

Kept apart from `dptrain.client`, whose methods are the API's routes: these are the few things
every route shares and that httpx leaves to the caller (a verified download to a temporary file,
the error body's shape).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import httpx

from dptrain.errors import api_error

CHUNK_BYTES = 1 << 20


def raise_for_status(r: httpx.Response) -> httpx.Response:
    """`r` itself if it succeeded; else raise the typed ApiError its status and body describe."""
    if r.status_code < 400:
        return r
    error = None
    try:
        body = r.json()
        detail = body.get("detail", body) if isinstance(body, dict) else body
        error = body.get("error") if isinstance(body, dict) else None
    except ValueError:
        detail = r.text or r.reason_phrase
    retry_after = retry_after_seconds(r.headers.get("Retry-After"))
    raise api_error(r.status_code, detail, error=error, retry_after=retry_after)


def retry_after_seconds(value: str | None, default: float = 1.0) -> float:
    """A Retry-After header's seconds (never negative); `default` if it is missing or not a number."""
    try:
        return max(0.0, float(value)) if value is not None else default
    except ValueError:
        return default


def download_verified(http: httpx.Client, path: str, dest: Path, sha256: str) -> None:
    """Stream `path` to `dest` through a temporary file, kept only if it hashes to `sha256`."""
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent or ".")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f, http.stream("GET", path) as r:
            if r.status_code >= 400:
                r.read()
                raise_for_status(r)
            for chunk in r.iter_bytes(CHUNK_BYTES):
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != sha256:
            raise ValueError(f"downloaded {path} hashes to {digest.hexdigest()}, not {sha256}")
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)


def chunks(f: BinaryIO) -> Iterator[bytes]:
    """`f`'s bytes in CHUNK_BYTES pieces, for a streamed upload."""
    while chunk := f.read(CHUNK_BYTES):
        yield chunk
