"""The code routes of `dptrain.Client`: pack a working directory, ship it once, fetch it back.

A mixin of `Client` (which sends the requests): the one part of the client that packs files and
streams them up, apart from the routes that only read and write JSON.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dptrain.left_out import LeftOut
from dptrain.transfer import chunks, download_verified, raise_for_status
from dptrain.workdir import Packed, pack


class CodeTooLarge(ValueError):
    """A working directory packs to more than `limit` bytes: the caller's, or (`by_server`) the server's."""

    def __init__(self, packed: Packed, *, limit: int, by_server: bool) -> None:
        name = "the server's DPTRAIN_CODE_MAX_BYTES" if by_server else "max_bytes"
        super().__init__(f"the archive is {packed.size_bytes} bytes, over {name} {limit}")
        self.packed = packed
        self.limit = limit
        self.by_server = by_server


@dataclass(frozen=True)
class CodeUpload:
    """A working directory as shipped: its sha256 and size, whether it was sent now, what it left out."""

    sha256: str
    size_bytes: int
    files: int
    skipped: list[tuple[str, str]]
    uploaded: bool
    left_out: LeftOut = field(default_factory=LeftOut)


class CodeRoutes:
    """`HEAD`, `PUT` and `GET /v1/code/{sha256}`, and packing a working directory for them."""

    http: httpx.Client

    def code_status(self, sha256: str) -> tuple[bool, int | None]:
        """Whether the server holds the archive `sha256` for you (you uploaded it), and its size limit."""
        r = self.http.head(f"/v1/code/{sha256}")
        limit = r.headers.get("X-Code-Max-Bytes", "")
        max_bytes = int(limit) if limit.isdigit() else None
        if r.status_code == 404:
            return False, max_bytes
        raise_for_status(r)
        return True, max_bytes

    def code_exists(self, sha256: str) -> bool:
        """Whether the server already holds that archive for you (another user's upload does not count)."""
        return self.code_status(sha256)[0]

    def upload_archive(self, sha256: str, path: Path) -> bool:
        """PUT the archive at `path` as `sha256`, streamed; True if stored now, False if already there."""
        with path.open("rb") as f:
            # A stated length lets the server refuse an archive over its limit before reading it.
            headers = {"Content-Type": "application/gzip", "Content-Length": str(path.stat().st_size)}
            r = self.http.put(f"/v1/code/{sha256}", content=chunks(f), headers=headers)
        return raise_for_status(r).status_code == 201

    def upload_code(
        self, workdir: str | os.PathLike[str], *, max_bytes: int | None = None, include: Sequence[str] = ()
    ) -> CodeUpload:
        """Pack `workdir` (minus .gitignore/.dptrainignore) and upload it unless the server has it.

        `include`: .gitignore-style patterns, relative to `workdir`, taking files the ignore files
        leave out (ValueError for a bad one); the result's `left_out` says what stayed out. Raises
        CodeTooLarge, before sending anything, if the archive is over `max_bytes` or the server's limit.
        """
        with tempfile.TemporaryDirectory(prefix="dptrain-code-") as tmp:
            packed = pack(Path(workdir), Path(tmp) / "code.tar.gz", include=include)
            if max_bytes is not None and packed.size_bytes > max_bytes:
                raise CodeTooLarge(packed, limit=max_bytes, by_server=False)
            held, server_max = self.code_status(packed.sha256)
            if not held and server_max is not None and packed.size_bytes > server_max:
                raise CodeTooLarge(packed, limit=server_max, by_server=True)
            uploaded = not held and self.upload_archive(packed.sha256, packed.path)
        return CodeUpload(
            packed.sha256, packed.size_bytes, packed.files, packed.skipped, uploaded, packed.left_out
        )

    def download_code(self, sha256: str, dest: Path) -> None:
        """GET the archive `sha256` into `dest`; ValueError (and no file) if its hash differs."""
        download_verified(self.http, f"/v1/code/{sha256}", dest, sha256)
