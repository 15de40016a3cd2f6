"""Incremental readers of files that ranks append to (events and logs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MAX_LINE_CHARS = 8000


@dataclass
class Tail:
    """Reads complete new lines of one growing file; a partial last line waits for its newline."""

    path: Path
    offset: int = 0
    pending: bytes = field(default=b"")

    def read_lines(self, *, final: bool = False) -> list[str]:
        """New complete lines since the last call (with `final`, a trailing partial line too)."""
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.pending + data
        *lines, rest = data.split(b"\n")
        self.pending = rest
        if final and rest:
            lines.append(rest)
            self.pending = b""
        return [ln.decode("utf-8", "replace").rstrip("\r")[:MAX_LINE_CHARS] for ln in lines]


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
