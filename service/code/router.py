"""Thin routes of `/v1/code`: content-addressed code archives, streamed in and out."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Request, Response, status
from fastapi.responses import FileResponse

from service.code import service, storage
from service.deps import CurrentUser, SessionDep, SettingsDep, run_in_transaction
from service.errors import Forbidden, NotFound, PayloadTooLarge, error_responses
from service.routing import v1_router

router = v1_router("code")

Sha256Path = Annotated[
    str, Path(pattern=r"^[0-9a-f]{64}$", description="sha256 of the .tar.gz, lower-case hex.")
]
_ARCHIVE = {"content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}}}
MAX_BYTES_HEADER = "X-Code-Max-Bytes"
# A refusal sent before the whole body was read: the connection cannot carry another request.
_CLOSE = {"Connection": "close"}


@router.head("/{sha256}", responses=error_responses(NotFound) | {200: {"description": "Stored"}})
def has_code(sha256: Sha256Path, session: SessionDep, user: CurrentUser, settings: SettingsDep) -> Response:
    """200 with the archive's Content-Length if you may use it (you uploaded it), else 404: upload it.

    404 alike for an archive that is not stored and one only others uploaded, so the answer tells
    nobody what others hold. Both answers carry the server's size limit (`X-Code-Max-Bytes`), so a
    client refuses an archive over it before sending a byte, rather than meeting a 413 mid-upload.
    """
    limit = {MAX_BYTES_HEADER: str(settings.code_max_bytes)}
    size = service.usable_size(session, user=user, sha256=sha256, artifacts=settings.artifacts)
    if size is None:
        # The media type a GET's 404 would have, though a HEAD answer carries no body.
        return Response(status_code=status.HTTP_404_NOT_FOUND, headers=limit, media_type="application/json")
    return Response(headers={"Content-Length": str(size), **limit}, media_type="application/gzip")


@router.put(
    "/{sha256}",
    status_code=status.HTTP_201_CREATED,
    response_class=Response,
    responses=error_responses(Forbidden, PayloadTooLarge) | {200: {"description": "Already yours"}},
    openapi_extra={"requestBody": {"required": True, **_ARCHIVE}},
)
async def put_code(
    sha256: Sha256Path, request: Request, session: SessionDep, user: CurrentUser, settings: SettingsDep
) -> Response:
    """Store a `.tar.gz` under its sha256 and record you as an uploader (201); 200 if you already were.

    Whoever did not upload it sends the bytes even when the server holds them: the hash they hash to
    is the proof, and the 201 does not tell them whether another user had stored them first.
    """
    service.check_may_upload(user=user, settings=settings)
    limit, artifacts = settings.code_max_bytes, settings.artifacts
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(settings)
    if await run_in_transaction(session, service.reuse, user=user, sha256=sha256, artifacts=artifacts):
        # Read to the end (up to the limit) so that the client, still sending, gets the answer.
        whole = await storage.drain(request.stream(), max_bytes=limit)
        return Response(status_code=status.HTTP_200_OK, headers=None if whole else _CLOSE)
    try:
        received = await storage.receive(request.stream(), artifacts=artifacts, max_bytes=limit)
    except storage.TooLarge:
        raise _too_large(settings) from None
    await run_in_transaction(
        session, service.store, user=user, sha256=sha256, received=received, artifacts=artifacts
    )
    return Response(status_code=status.HTTP_201_CREATED)


def _too_large(settings: SettingsDep) -> PayloadTooLarge:
    return PayloadTooLarge(service.too_large_message(settings), headers=_CLOSE)


@router.get(
    "/{sha256}",
    response_class=FileResponse,
    responses=error_responses(NotFound) | {200: _ARCHIVE},
)
def get_code(
    sha256: Sha256Path, session: SessionDep, user: CurrentUser, settings: SettingsDep
) -> FileResponse:
    """The archive, for an admin and its uploaders (404 for anyone else, as for an unknown archive)."""
    path = service.readable_archive(session, user=user, sha256=sha256, artifacts=settings.artifacts)
    return FileResponse(
        path, media_type="application/gzip", filename=f"{sha256}.tar.gz", headers={"X-Code-SHA256": sha256}
    )
