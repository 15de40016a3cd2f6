"""The client's code calls: HEAD before PUT, the archive streamed as gzip, refusals kept as ApiError."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from dptrain.client import Client
from dptrain.errors import ApiError

ARCHIVE = bytes(range(256)) * 9000  # over two upload chunks
SHA = hashlib.sha256(ARCHIVE).hexdigest()


def client_of(handler: Callable[[httpx.Request], httpx.Response]) -> Client:
    """A Client whose server is `handler`."""
    client = Client("http://api", token="t")
    client.http = httpx.Client(base_url="http://api", transport=httpx.MockTransport(handler))
    return client


@pytest.mark.parametrize(("status", "exists"), [(200, True), (404, False)])
def test_code_exists_asks_with_head(status: int, exists: bool) -> None:
    seen: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return httpx.Response(status)

    assert client_of(server).code_exists(SHA) is exists
    assert seen == [f"HEAD /v1/code/{SHA}"]


def test_code_exists_raises_what_is_neither_yes_nor_no() -> None:
    with pytest.raises(ApiError) as caught:
        client_of(lambda _r: httpx.Response(403)).code_exists(SHA)
    assert caught.value.status_code == 403 and caught.value.detail == "Forbidden", caught.value


@pytest.mark.parametrize(("status", "stored_now"), [(201, True), (200, False)])
def test_upload_streams_the_file_as_gzip(tmp_path: Path, status: int, stored_now: bool) -> None:
    path = tmp_path / "code.tar.gz"
    path.write_bytes(ARCHIVE)
    received: list[httpx.Request] = []

    def server(request: httpx.Request) -> httpx.Response:
        request.read()
        received.append(request)
        return httpx.Response(status, json={"sha256": SHA})

    assert client_of(server).upload_archive(SHA, path) is stored_now
    (request,) = received
    assert request.method == "PUT" and request.url.path == f"/v1/code/{SHA}"
    assert request.headers["Content-Type"] == "application/gzip"
    assert (
        request.headers["Content-Length"] == str(len(ARCHIVE)) and "Transfer-Encoding" not in request.headers
    )
    assert request.content == ARCHIVE


def test_an_upload_over_the_limit_keeps_the_servers_detail(tmp_path: Path) -> None:
    path = tmp_path / "code.tar.gz"
    path.write_bytes(ARCHIVE)
    detail = "code archive is over DPTRAIN_CODE_MAX_BYTES (1024 bytes)"
    with pytest.raises(ApiError) as caught:
        client_of(
            lambda _r: httpx.Response(413, json={"error": "too_large", "detail": detail})
        ).upload_archive(SHA, path)
    assert caught.value.status_code == 413 and caught.value.detail == detail


def test_download_writes_the_archive_and_checks_its_hash(tmp_path: Path) -> None:
    dest = tmp_path / "got.tar.gz"
    client_of(lambda _r: httpx.Response(200, content=ARCHIVE)).download_code(SHA, dest)
    assert dest.read_bytes() == ARCHIVE
    with pytest.raises(ValueError, match="hashes to"):
        client_of(lambda _r: httpx.Response(200, content=ARCHIVE[1:])).download_code(SHA, tmp_path / "bad")
    assert not (tmp_path / "bad").exists(), "bytes that are not the archive asked for are not kept"
    with pytest.raises(ApiError) as caught:
        client_of(lambda _r: httpx.Response(404, json={"detail": "no such code"})).download_code(
            SHA, tmp_path / "missing"
        )
    assert caught.value.status_code == 404 and caught.value.detail == "no such code"
