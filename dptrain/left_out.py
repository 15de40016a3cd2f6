"""What packing a working directory leaves out, so the uploader can say it, and `--include` to take it.

The ignore files are written for git: they keep data and weights out of a repository (nanoGPT's
`.gitignore` has `*.bin` and `*.pkl`), which is often exactly what a job needs. So nothing is left
out silently: the ignored files that look like data or weights are listed, the other ignored files
counted, and what is never code (version control, environments, caches) named in one line.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from pathspec import GitIgnoreSpec

# Suffixes of data sets, tokenised corpora, model weights and archives of them.
DATA_SUFFIXES = frozenset(
    {
        # weights and pickled state
        ".bin", ".pkl", ".pickle", ".pt", ".pth", ".ckpt", ".safetensors", ".gguf", ".onnx", ".msgpack",
        # arrays and tables
        ".npy", ".npz", ".h5", ".hdf5", ".parquet", ".arrow", ".feather", ".csv", ".tsv", ".jsonl",
        ".tfrecord", ".lmdb", ".mdb", ".db", ".sqlite", ".idx", ".mat",
        # archives
        ".tar", ".zip", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z",
        # media data sets are made of
        ".jpg", ".jpeg", ".png", ".wav", ".flac", ".mp3", ".mp4",
    }
)  # fmt: skip
# Whatever its name, a file this big is not source code.
DATA_MIN_BYTES = 1 << 20
# How many paths of a kind are kept to show (the count and total cover them all).
SHOWN = 20


def looks_like_data(rel: str, size: int) -> bool:
    """Whether an ignored file is likely data or weights a job needs: by its suffix or its size."""
    return size > DATA_MIN_BYTES or PurePosixPath(rel).suffix.lower() in DATA_SUFFIXES


@dataclass
class Tally:
    """Files of one kind: how many, their total bytes, and the biggest (biggest first, ties by path)."""

    count: int = 0
    bytes: int = 0
    _kept: list[tuple[str, int]] = field(default_factory=list)

    def add(self, rel: str, size: int) -> None:
        """Count one file."""
        self.count += 1
        self.bytes += size
        self._kept.append((rel, size))
        if len(self._kept) > 4 * SHOWN:  # bounded, however many files an ignored directory holds
            self._kept = self.biggest

    @property
    def biggest(self) -> list[tuple[str, int]]:
        """Up to SHOWN of the files, biggest first."""
        return heapq.nsmallest(SHOWN, self._kept, key=lambda item: (-item[1], item[0]))


@dataclass
class LeftOut:
    """What the archive leaves out, and what `include` patterns took that the ignore rules would not."""

    data: Tally = field(default_factory=Tally)  # ignored files that look like data or weights
    other: Tally = field(default_factory=Tally)  # every other ignored file
    never: Counter[str] = field(default_factory=Counter)  # never packed: ".git/", "*.pyc" -> how many
    included: Tally = field(default_factory=Tally)  # ignored, but taken by an include pattern
    unmatched: list[str] = field(default_factory=list)  # include patterns that took nothing

    def ignored(self, rel: str, size: int) -> None:
        """Count a file the ignore rules leave out."""
        (self.data if looks_like_data(rel, size) else self.other).add(rel, size)


class Include:
    """Include patterns (.gitignore syntax, relative to the working directory's root, the last match wins).

    They take files that the ignore files leave out, inside ignored directories too; they never take
    what is always left out (version control, environments, caches).
    """

    def __init__(self, patterns: Sequence[str]) -> None:
        """One spec per pattern, to tell which ones took something; ValueError for a bad pattern."""
        self.patterns = list(patterns)
        try:
            self._specs = [GitIgnoreSpec.from_lines([p]) for p in self.patterns]
        except Exception as exc:  # pathspec's own error types vary by version
            raise ValueError(f"bad --include pattern: {exc}") from exc
        self._used: set[int] = set()

    def takes(self, rel: str) -> bool:
        """Whether the patterns take the file `rel` (a posix path relative to the root)."""
        for i in reversed(range(len(self._specs))):
            verdict = self._specs[i].check_file(rel).include
            if verdict is not None:
                if verdict:
                    self._used.add(i)
                return verdict
        return False

    def unmatched(self) -> list[str]:
        """The patterns that took no file."""
        return [p for i, p in enumerate(self.patterns) if i not in self._used and not p.startswith("!")]


def mb(size: int) -> str:
    """`size` in decimal megabytes, as people read upload sizes."""
    return f"{size / 1e6:.1f} MB"


def suggested_includes(paths: Iterable[str]) -> list[str]:
    """Patterns that would take these paths: `*.bin` for a data suffix, else the path (big by size alone)."""
    found = set()
    for path in paths:
        suffix = PurePosixPath(path).suffix
        found.add(f"*{suffix}" if suffix.lower() in DATA_SUFFIXES else path)
    return sorted(found)


def data_warning(left_out: LeftOut, workdir: str) -> str | None:
    """One sentence on the data and weights left out of `workdir`, or None if there are none."""
    data = left_out.data
    if not data.count:
        return None
    shown = ", ".join(rel for rel, _ in data.biggest[:5]) + (", ..." if data.count > 5 else "")
    takes = ", ".join(repr(p) for p in suggested_includes(rel for rel, _ in data.biggest))
    return (
        f"{data.count} files of {workdir} that look like data or weights ({mb(data.bytes)}: {shown}) were "
        f"left out by its ignore rules; include=[{takes}] takes them"
    )
