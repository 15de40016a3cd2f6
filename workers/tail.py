"""Incremental readers of files that ranks append to (events and logs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MAX_LINE_CHARS = 8000
# Bytes of one line held while its newline has not come: enough for MAX_LINE_CHARS characters of
# any UTF-8; the rest of a longer line is counted, never held, so a rank printing megabytes without
# a newline costs the worker no memory.
_MAX_LINE_BYTES = 4 * MAX_LINE_CHARS
# Read at most this much of a file at once, for the same reason.
_CHUNK_BYTES = 1 << 20


def cut_marker(dropped: int) -> str:
    """What ends a line that was longer than MAX_LINE_CHARS."""
    return f" [dptrain: line cut, {dropped} more bytes dropped]"


@dataclass
class Tail:
    """Reads complete new lines of one growing file; a partial last line waits for its newline."""

    path: Path
    offset: int = 0
    pending: bytes = field(default=b"")
    # Bytes of the pending line dropped past _MAX_LINE_BYTES.
    cut: int = 0

    def read_lines(self, *, final: bool = False) -> list[str]:
        """New complete lines since the last call (with `final`, a trailing partial line too)."""
        lines: list[str] = []
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                while chunk := f.read(_CHUNK_BYTES):
                    self.offset += len(chunk)
                    *complete, rest = chunk.split(b"\n")
                    for piece in complete:
                        lines.append(self._line(self._hold(piece)))
                    self.pending = self._hold(rest)
        except FileNotFoundError:
            return lines
        if final and (self.pending or self.cut):
            lines.append(self._line(self.pending))
        return lines

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


class TailSet:
    """Tails of every file matching a glob in a folder, picked up as they appear."""

    def __init__(self, folder: Path, pattern: str) -> None:
        self.folder = folder
        self.pattern = pattern
        self.tails: dict[Path, Tail] = {}

    def read(self, *, final: bool = False) -> list[tuple[Path, str]]:
        """(file, line) for every new line of every matching file."""
        for path in sorted(self.folder.glob(self.pattern)):
            self.tails.setdefault(path, Tail(path))
        out: list[tuple[Path, str]] = []
        for path, tail in self.tails.items():
            out.extend((path, line) for line in tail.read_lines(final=final))
        return out
