"""Incremental readers of files that ranks append to (events and logs), read as hostile input.

Every file is opened through rank_contract.files, relative to a descriptor of its folder, with no
link followed: a rank that swaps its log for a link to a host file, or its logs/ folder for a link
to a host folder, gets nothing read from there. A name that is a link, a FIFO or anything but a
regular file is skipped (and listed in `TailSet.refused`), never read.

A log file is also kept near its budget on disk (`truncate_past`, DPTRAIN_MAX_LOG_BYTES_PER_JOB):
once a file has handed over that many bytes, what it holds past them is counted, not read (the job's
stored log is full by then), and the file is emptied whenever it holds a chunk (1 MiB) past the
budget. The ranks write with O_APPEND, so their next line lands at the new start: a file on disk
stays within the budget, plus one chunk, plus what the ranks write between two reads.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from rank_contract.files import folder, names, open_fd_in

MAX_LINE_CHARS = 8000
# Bytes of one line held while its newline has not come: enough for MAX_LINE_CHARS characters of
# any UTF-8; the rest of a longer line is counted, never held, so a rank printing megabytes without
# a newline costs the worker no memory.
_MAX_LINE_BYTES = 4 * MAX_LINE_CHARS
# Read at most this much of a file at once, for the same reason.
_CHUNK_BYTES = 1 << 20
# Past its budget a file is scanned for newlines, to count the lines dropped, this much a read at
# most; the rest is counted in bytes alone (a rank writing faster than the worker reads, a sparse file).
_SCAN_BYTES = 16 << 20


def cut_marker(dropped: int) -> str:
    """What ends a line that was longer than MAX_LINE_CHARS."""
    return f" [dptrain: line cut, {dropped} more bytes dropped]"


@dataclass
class Tail:
    """Reads complete new lines of one growing file; a partial last line waits for its newline.

    With `truncate_past`, the file is kept near that many bytes on disk (see the module's docstring);
    `dropped_lines` and `dropped_bytes` count what was cut unread since `take_dropped` last asked.
    """

    path: Path
    truncate_past: int | None = None
    offset: int = 0
    pending: bytes = field(default=b"")
    # Bytes of the pending line dropped past _MAX_LINE_BYTES.
    cut: int = 0
    # Bytes read of this file in all (across truncations): past `truncate_past`, lines are only counted.
    handed: int = 0
    dropped_lines: int = 0
    dropped_bytes: int = 0
    # (device, inode) of the file read last: another file under the same name is read from its start.
    identity: tuple[int, int] | None = None
    # Whether the last open found something other than a regular file (a link, a FIFO) there.
    refused: bool = False

    def read_lines(self, *, final: bool = False, folder_fd: int | None = None) -> list[str]:
        """New complete lines since the last call (with `final`, a trailing partial line too).

        `folder_fd`: the open folder of the file (a TailSet's); without it, the file's parent is opened.
        """
        if folder_fd is None:
            with folder(self.path.parent) as fd:
                return self.read_lines(final=final, folder_fd=fd) if fd is not None else []
        lines: list[str] = []
        fd = open_fd_in(folder_fd, self.path.name, write=self.truncate_past is not None)
        self.refused = fd is None and _exists(folder_fd, self.path.name)
        if fd is not None:
            with os.fdopen(fd, "rb") as f:
                self._read(f, lines)
        if final and (self.pending or self.cut):
            lines.append(self._line(self.pending))
        return lines

    def _read(self, f: BinaryIO, lines: list[str]) -> None:
        st = os.fstat(f.fileno())
        if self.identity != (st.st_dev, st.st_ino) or st.st_size < self.offset:
            # Another file under this name, or this one emptied by its writer: read it from its start.
            self.identity, self.offset = (st.st_dev, st.st_ino), 0
        f.seek(self.offset)
        budget = self.truncate_past
        while budget is None or self.handed < budget:
            chunk = f.read(_CHUNK_BYTES if budget is None else min(_CHUNK_BYTES, budget - self.handed))
            if not chunk:
                break
            self.offset += len(chunk)
            self.handed += len(chunk)
            *complete, rest = chunk.split(b"\n")
            for piece in complete:
                lines.append(self._line(self._hold(piece)))
            self.pending = self._hold(rest)
        if budget is None or self.handed < budget:
            return
        # Past the budget: what follows is counted, not read into lines.
        scanned = 0
        while scanned < _SCAN_BYTES and (chunk := f.read(min(_CHUNK_BYTES, _SCAN_BYTES - scanned))):
            scanned += len(chunk)
            self.dropped_lines += chunk.count(b"\n")
        self.offset += scanned
        self.dropped_bytes += scanned
        # Emptied once it holds a chunk past the budget (a small overflow stays, its lines counted
        # exactly). Lines a rank appends between the last read and the truncation are counted in
        # bytes alone, as is what lies past one read's scan.
        size = os.fstat(f.fileno()).st_size
        if size < budget + _CHUNK_BYTES:
            return
        with contextlib.suppress(OSError):  # opened read-only (a worker that may not write it): left as is
            os.ftruncate(f.fileno(), 0)
            self.dropped_bytes += max(0, size - self.offset)
            self.offset = 0

    def take_dropped(self) -> tuple[int, int]:
        """(lines, bytes) cut from the file unread since the last call."""
        dropped = (self.dropped_lines, self.dropped_bytes)
        self.dropped_lines = self.dropped_bytes = 0
        return dropped

    def _hold(self, piece: bytes) -> bytes:
        data = self.pending + piece
        if len(data) > _MAX_LINE_BYTES:
            self.cut += len(data) - _MAX_LINE_BYTES
            data = data[:_MAX_LINE_BYTES]
        return data

    def _line(self, data: bytes) -> str:
        cut, self.pending, self.cut = self.cut, b"", 0
        text = data.decode("utf-8", "replace")
        if not cut:
            text = text.rstrip("\r")
        if len(text) > MAX_LINE_CHARS:
            cut += len(text[MAX_LINE_CHARS:].encode("utf-8", "replace"))
            text = text[:MAX_LINE_CHARS]
        return text + cut_marker(cut) if cut else text


def _exists(folder_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


class TailSet:
    """Tails of every file matching a glob in a folder under `root`, picked up as they appear.

    The folder is opened beneath `root` with no link followed at each read: a folder swapped for a
    link yields nothing, and every file is opened relative to that descriptor.
    """

    def __init__(self, root: Path, folder: str, pattern: str, *, truncate_past: int | None = None) -> None:
        self.root = root
        self.folder = folder
        self.pattern = pattern
        self.truncate_past = truncate_past
        self.tails: dict[str, Tail] = {}

    def read(self, *, final: bool = False) -> list[tuple[Path, str]]:
        """(file, line) for every new line of every matching regular file."""
        out: list[tuple[Path, str]] = []
        with folder(self.root, self.folder) as fd:
            if fd is None:
                return out
            for name in fnmatch.filter(names(fd), self.pattern):
                path = self.root / self.folder / name
                self.tails.setdefault(name, Tail(path, truncate_past=self.truncate_past))
            for tail in self.tails.values():
                out.extend((tail.path, line) for line in tail.read_lines(final=final, folder_fd=fd))
        return out

    @property
    def refused(self) -> list[str]:
        """The names matching the glob that were a link or no regular file when last read."""
        return sorted(name for name, tail in self.tails.items() if tail.refused)

    def take_dropped(self) -> tuple[int, int]:
        """(lines, bytes) cut unread from all the files since the last call."""
        taken = [tail.take_dropped() for tail in self.tails.values()]
        return sum(t[0] for t in taken), sum(t[1] for t in taken)
