"""A small HTTP client of the v1 API for the CLI (and tests)."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from service.config import Settings, get_settings

SUBMIT_ATTEMPTS = 3
CHUNK_BYTES = 1 << 20


class ApiError(Exception):
    """The API refused a request; `detail` is what it said."""

    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


def resolve_token(settings: Settings) -> str | None:
    """DPTRAIN_TOKEN, else the token `dptrain up` wrote under DPTRAIN_HOME."""
    if settings.token is not None:
        return settings.token.get_secret_value()
    path = Path(settings.home) / "token"
    return path.read_text().strip() if path.is_file() else None


class Client:
    """Calls the API at DPTRAIN_API_URL with DPTRAIN_TOKEN."""

    def __init__(self, base_url: str, token: str | None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    @classmethod
    def from_env(cls) -> Client:
        """A client configured from the environment."""
        settings = get_settings()
        return cls(settings.api_url, resolve_token(settings))

    @staticmethod
    def _check(r: httpx.Response) -> httpx.Response:
        if r.status_code >= 400:
            try:
                body = r.json()
                detail = body.get("detail", body)
            except ValueError:
                detail = r.text or r.reason_phrase
            raise ApiError(r.status_code, detail)
        return r

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        return self._check(self.http.request(method, path, **kw)).json()

    def submit(self, spec: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        """POST /v1/jobs under an Idempotency-Key, retried on network errors: never two jobs for one call."""
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        for attempt in range(SUBMIT_ATTEMPTS):
            try:
                return dict(self._call("POST", "/v1/jobs", json=spec, headers=headers))
            except httpx.TransportError:
                # The request may have been accepted before the connection broke: the same key
                # makes the retry answer that job instead of submitting a second one.
                if attempt == SUBMIT_ATTEMPTS - 1:
                    raise
                time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    def get(self, job_id: str) -> dict[str, Any]:
        """GET /v1/jobs/{id}."""
        return dict(self._call("GET", f"/v1/jobs/{job_id}"))

    def list(self, *, limit: int = 50, status: str | None = None) -> dict[str, Any]:
        """GET /v1/jobs."""
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        return dict(self._call("GET", "/v1/jobs", params=params))

    def cancel(self, job_id: str) -> dict[str, Any]:
        """POST /v1/jobs/{id}/cancel."""
        return dict(self._call("POST", f"/v1/jobs/{job_id}/cancel"))

    def logs(self, job_id: str, *, after: int | None = None, rank: int | None = None) -> dict[str, Any]:
        """GET /v1/jobs/{id}/logs."""
        params = {k: v for k, v in {"after": after, "rank": rank}.items() if v is not None}
        return dict(self._call("GET", f"/v1/jobs/{job_id}/logs", params=params))

    def code_exists(self, sha256: str) -> bool:
        """HEAD /v1/code/{sha256}: whether the server already holds that archive."""
        return self.code_status(sha256)[0]

    def code_status(self, sha256: str) -> tuple[bool, int | None]:
        """HEAD /v1/code/{sha256}: (held by the server, the server's archive size limit if it says)."""
        r = self.http.head(f"/v1/code/{sha256}")
        limit = r.headers.get("X-Code-Max-Bytes", "")
        max_bytes = int(limit) if limit.isdigit() else None
        if r.status_code == 404:
            return False, max_bytes
        self._check(r)
        return True, max_bytes

    def upload_code(self, sha256: str, path: Path) -> bool:
        """PUT /v1/code/{sha256} streaming the file at `path`; True if stored now, False if already there."""
        with path.open("rb") as f:
            # A stated length lets the server refuse an archive over its limit before reading it.
            headers = {"Content-Type": "application/gzip", "Content-Length": str(path.stat().st_size)}
            r = self.http.put(f"/v1/code/{sha256}", content=_chunks(f), headers=headers)
        return self._check(r).status_code == 201

    def download_code(self, sha256: str, dest: Path) -> None:
        """GET /v1/code/{sha256} into `dest`, streamed; ValueError (and no file) if its hash differs."""
        digest = hashlib.sha256()
        with self.http.stream("GET", f"/v1/code/{sha256}") as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            with dest.open("wb") as f:
                for chunk in r.iter_bytes(CHUNK_BYTES):
                    digest.update(chunk)
                    f.write(chunk)
        if digest.hexdigest() != sha256:
            dest.unlink()
            raise ValueError(f"downloaded code hashes to {digest.hexdigest()}, not {sha256}")


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(CHUNK_BYTES):
        yield chunk
