"""Code archives on disk (`<artifact root>/code/<sha256>.tar.gz`, rank_contract.layout): received and swept.

Free of FastAPI and SQL: the worker's reconciler sweeps partial uploads with it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import AsyncIterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import anyio.to_thread

from rank_contract.layout import code_archive, code_folder

GZIP_MAGIC = b"\x1f\x8b"
# An upload being received; left behind only by an API process that died mid-upload.
_PARTIAL_PREFIX, _PARTIAL_SUFFIX = ".upload-", ".part"
# Received bytes are hashed and written in pieces of about this size: one thread hop per piece.
_PIECE = 1 << 20


class TooLarge(Exception):
    """The body grew past the limit; nothing was kept."""


@dataclass
class Received:
    """An upload written to a temporary file next to the archives, not yet in place."""

    path: Path
    sha256: str
    size: int
    head: bytes

    def discard(self) -> None:
        """Remove the temporary file."""
        self.path.unlink(missing_ok=True)

    def keep(self, artifacts: Path) -> Path:
        """Move the file into place as the archive of its hash (atomic: readers see all or nothing)."""
        dest = code_archive(artifacts, self.sha256)
        os.replace(self.path, dest)
        return dest


async def receive(chunks: AsyncIterable[bytes], *, artifacts: Path, max_bytes: int) -> Received:
    """Stream `chunks` to a temporary file in the code folder while hashing; TooLarge past `max_bytes`."""
    folder = code_folder(artifacts)
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=folder, prefix=_PARTIAL_PREFIX, suffix=_PARTIAL_SUFFIX)
    path = Path(name)
    digest, size, head, pending = hashlib.sha256(), 0, b"", bytearray()
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise TooLarge(f"{size} bytes received")
                if len(head) < len(GZIP_MAGIC):
                    head = (head + chunk)[: len(GZIP_MAGIC)]
                pending += chunk
                if len(pending) >= _PIECE:
                    await anyio.to_thread.run_sync(_write, f, digest, bytes(pending))
                    pending.clear()
            await anyio.to_thread.run_sync(_write, f, digest, bytes(pending))
    except BaseException:
        # A refusal, a client that went away, a full disk: no partial upload is left behind.
        path.unlink(missing_ok=True)
        raise
    return Received(path=path, sha256=digest.hexdigest(), size=size, head=head)


def _write(f: BinaryIO, digest: Any, data: bytes) -> None:
    digest.update(data)
    f.write(data)


async def drain(chunks: AsyncIterable[bytes], *, max_bytes: int) -> bool:
    """Read and drop a body the server does not need; False if it went past `max_bytes` (left unread)."""
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            return False
    return True


def sweep_partial_uploads(artifacts: Path, *, older_than_seconds: float) -> int:
    """Delete uploads that a dead API process left half-received; returns how many."""
    cutoff = time.time() - older_than_seconds
    swept = 0
    for path in code_folder(artifacts).glob(f"{_PARTIAL_PREFIX}*{_PARTIAL_SUFFIX}"):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                swept += 1
        except FileNotFoundError:  # finished or swept by another process meanwhile
            continue
    return swept
