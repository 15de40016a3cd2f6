"""File downloads (artifacts, checkpoints): a file opened beneath its root, streamed as an attachment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import BinaryIO
from urllib.parse import quote

from fastapi.responses import StreamingResponse

CHUNK_BYTES = 1 << 20


def attachment(f: BinaryIO, *, name: str, headers: dict[str, str]) -> StreamingResponse:
    """Stream an open file (closed at the end) as `name`, with its size as Content-Length."""
    # An open file rather than a path (Starlette's FileResponse): the caller opened it with
    # `open_beneath`, so no link a rank planted after a check can make it another file.
    size = os.fstat(f.fileno()).st_size
    headers = headers | {
        "Content-Length": str(size),
        "Content-Disposition": f"attachment; filename*=UTF-8''{quote(name)}",
    }
    return StreamingResponse(_chunks(f, size), media_type="application/octet-stream", headers=headers)


def _chunks(f: BinaryIO, size: int) -> Iterator[bytes]:
    # Never more than the Content-Length sent: a running attempt may be appending to the file.
    with f:
        while size > 0 and (chunk := f.read(min(CHUNK_BYTES, size))):
            size -= len(chunk)
            yield chunk
