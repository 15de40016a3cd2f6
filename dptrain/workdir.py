"""Reproducible packing of a working directory into a content-addressed `.tar.gz`.

The same tree always gives the same bytes (and so the same sha256) on one machine, whatever the
files' mtimes, owners or the order the OS lists them: entries are sorted, metadata is fixed and the
gzip header carries no time or name. The bytes depend on zlib's version, so two machines may differ.
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import io
import os
import stat
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

from pathspec import GitIgnoreSpec

from dptrain.left_out import Include, LeftOut

IGNORE_FILES = (".gitignore", ".dptrainignore")
# Left out whatever the ignore files say: version control, caches and environments are never code.
ALWAYS_EXCLUDED = frozenset(
    {".git", "__pycache__", ".venv", "venv", ".tox", ".mypy_cache", ".pytest_cache", "node_modules"}
)
LARGEST = 10

Kind = Literal["dir", "file", "symlink"]


@dataclass(frozen=True)
class Entry:
    """One thing the archive holds: its relative posix path, where it is, and what it is."""

    rel: str
    path: Path
    kind: Kind
    size: int = 0
    executable: bool = False
    target: str = ""


@dataclass(frozen=True)
class Packed:
    """A packed archive: where it is, its sha256 and size, how many files, the biggest, what was left out.

    `skipped`: links and special files that cannot be packed, with why; `left_out`: what the ignore
    rules and the always-excluded names dropped.
    """

    path: Path
    sha256: str
    size_bytes: int
    files: int
    largest: list[tuple[str, int]]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    left_out: LeftOut = field(default_factory=LeftOut)


@dataclass(frozen=True)
class _Rules:
    """The ignore specs in force in one directory: (directory relative to the root, spec), outermost first."""

    specs: tuple[tuple[str, GitIgnoreSpec], ...] = ()

    def below(self, directory: Path, rel: str) -> _Rules:
        """These rules plus the ignore files `directory` itself holds (a .dptrainignore beats .gitignore)."""
        lines: list[str] = []
        for name in IGNORE_FILES:
            ignore_file = directory / name
            if ignore_file.is_file():
                lines += ignore_file.read_text(encoding="utf-8", errors="replace").splitlines()
        if not lines:
            return self
        return _Rules((*self.specs, (rel, GitIgnoreSpec.from_lines(lines))))

    def ignores(self, rel: str, is_dir: bool) -> bool:
        """Git's answer: the deepest ignore file with a matching pattern decides, its last match wins."""
        for base, spec in reversed(self.specs):
            sub = rel[len(base) + 1 :] if base else rel
            verdict = spec.check_file(sub + "/" if is_dir else sub).include
            if verdict is not None:
                return verdict
        return False


def _symlink_problem(root_real: str, parent_rel: str, path: Path) -> str | None:
    target = os.readlink(path)
    if os.path.isabs(target):
        return f"absolute symlink to {target}"
    lexical = os.path.normpath(os.path.join(parent_rel or ".", target))
    real = os.path.realpath(path)
    if lexical == ".." or lexical.startswith("../") or os.path.commonpath([real, root_real]) != root_real:
        return f"symlink to {target} leaves the tree"
    return None


def _special_kind(mode: int) -> str:
    for test, what in ((stat.S_ISSOCK, "socket"), (stat.S_ISFIFO, "fifo"), (stat.S_ISCHR, "device")):
        if test(mode):
            return what
    return "device" if stat.S_ISBLK(mode) else "not a regular file"


def _never_key(path: Path, name: str, is_dir: bool) -> str | None:
    """How an entry that is never packed is named in the summary (`.git/`, `*.pyc`), None if it may be."""
    if name in ALWAYS_EXCLUDED or (is_dir and (path / "pyvenv.cfg").exists()):  # any venv, whatever its name
        return f"{name}/" if is_dir else name
    return "*.pyc" if name.endswith(".pyc") else None


def walk(
    directory: Path,
    skipped: list[tuple[str, str]] | None = None,
    *,
    left_out: LeftOut | None = None,
    include: Include | None = None,
) -> Iterator[Entry]:
    """Every entry the archive of `directory` holds, in archive order; what is left out goes to `skipped`.

    With `left_out`, what the ignore rules and the always-excluded names drop is counted there (ignored
    directories are then walked, sizes only); `include` takes ignored files back.
    """
    root = Path(directory)
    root_real = os.path.realpath(root)
    found = skipped if skipped is not None else []
    # Ignored directories are entered only to report them or to take files back from them.
    enter_ignored = left_out is not None or include is not None

    def scan(folder: Path, prefix: str, rules: _Rules, ignored: bool) -> Iterator[Entry]:
        # Inside an ignored directory everything is ignored, as in git: its ignore files change nothing.
        rules = rules if ignored else rules.below(folder, prefix)
        with os.scandir(folder) as it:
            children = sorted(it, key=lambda e: e.name)
        for child in children:
            rel = f"{prefix}/{child.name}" if prefix else child.name
            path = Path(child.path)
            is_dir = child.is_dir(follow_symlinks=False)
            if (never := _never_key(path, child.name, is_dir)) is not None:
                if left_out is not None:
                    left_out.never[never] += 1
                continue
            dropped = ignored or rules.ignores(rel, is_dir)
            if is_dir:
                if not dropped:
                    yield Entry(rel, path, "dir")
                    yield from scan(path, rel, rules, False)
                elif enter_ignored and (taken := list(scan(path, rel, rules, True))):
                    yield Entry(rel, path, "dir")  # it holds files an include pattern took
                    yield from taken
                continue
            st = child.stat(follow_symlinks=False)
            if dropped:
                size = st.st_size if stat.S_ISREG(st.st_mode) else 0
                if include is None or not include.takes(rel):
                    if left_out is not None:
                        left_out.ignored(rel, size)
                    continue
                if left_out is not None:
                    left_out.included.add(rel, size)
            if child.is_symlink():
                problem = _symlink_problem(root_real, prefix, path)
                if problem:
                    found.append((rel, problem))
                else:
                    yield Entry(rel, path, "symlink", target=os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                yield Entry(rel, path, "file", st.st_size, bool(st.st_mode & 0o111))
            else:
                found.append((rel, _special_kind(st.st_mode)))

    yield from scan(root, "", _Rules(), False)


def _biggest(sizes: Iterable[tuple[str, int]], n: int) -> list[tuple[str, int]]:
    return heapq.nsmallest(n, sizes, key=lambda item: (-item[1], item[0]))


def included_files(directory: Path) -> list[tuple[str, Path]]:
    """The files and in-tree symlinks the archive of `directory` would hold, by relative posix path."""
    return [(e.rel, e.path) for e in walk(directory) if e.kind != "dir"]


def largest_paths(directory: Path, n: int = LARGEST) -> list[tuple[str, int]]:
    """The `n` biggest files the archive would hold, biggest first; reads sizes only, never contents."""
    files = ((e.rel, e.size) for e in walk(directory) if e.kind == "file")
    return _biggest(files, n)


def largest_top_level(directory: Path, n: int = LARGEST) -> list[tuple[str, int]]:
    """Bytes the archive would hold under each top-level entry (`data/` for a directory), biggest first."""
    totals: dict[str, int] = {}
    for e in walk(directory):
        if e.kind == "file":
            top, sep, _ = e.rel.partition("/")
            key = top + sep
            totals[key] = totals.get(key, 0) + e.size
    return _biggest(totals.items(), n)


def _tarinfo(entry: Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.rel)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.kind == "dir":
        info.type, info.mode = tarfile.DIRTYPE, 0o755
    elif entry.kind == "symlink":
        info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, entry.target
    else:
        info.mode = 0o755 if entry.executable else 0o644
        info.size = entry.size
    return info


class _Hashing(io.RawIOBase):
    """A write-only file that hashes what goes through it: the archive is hashed as it is written."""

    def __init__(self, raw: BinaryIO, digest: Any) -> None:
        super().__init__()
        self.raw, self.digest = raw, digest

    def writable(self) -> bool:
        """A writer, never a reader."""
        return True

    def write(self, data: Any) -> int:
        """Hash and write `data`."""
        self.digest.update(data)
        return self.raw.write(data)


def pack(directory: Path, out: Path, *, include: Sequence[str] = ()) -> Packed:
    """Write `directory` as a reproducible `.tar.gz` to `out` (never packing `out` itself).

    `include`: .gitignore-style patterns, relative to `directory`, that take files its ignore files
    leave out (dptrain/left_out.py); ValueError for a bad one. The result's `left_out` says what was.
    """
    skipped: list[tuple[str, str]] = []
    left_out = LeftOut()
    taking = Include(include) if include else None
    out_abs = os.path.join(os.path.realpath(Path(out).parent), Path(out).name)
    out_rel = Path(os.path.relpath(out_abs, os.path.realpath(directory))).as_posix()
    entries = [e for e in walk(directory, skipped, left_out=left_out, include=taking) if e.rel != out_rel]
    left_out.unmatched = taking.unmatched() if taking else []
    digest = hashlib.sha256()
    with (
        open(out, "wb") as raw,
        _Hashing(raw, digest) as hashed,
        gzip.GzipFile(fileobj=hashed, mode="wb", mtime=0, filename="", compresslevel=6) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar,
    ):
        for entry in entries:
            info = _tarinfo(entry)
            if entry.kind == "file":
                with open(entry.path, "rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)
    files = [(e.rel, e.size) for e in entries if e.kind == "file"]
    return Packed(
        path=Path(out),
        sha256=digest.hexdigest(),
        size_bytes=os.path.getsize(out),
        files=sum(e.kind != "dir" for e in entries),
        largest=_biggest(files, LARGEST),
        skipped=skipped,
        left_out=left_out,
    )
