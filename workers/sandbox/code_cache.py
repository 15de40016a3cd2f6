"""Users' code archives, checked and unpacked once per sha256 into a read-only cache on the worker.

`safe_extract` reads an archive twice: a first pass refuses anything hostile before a byte is
written (each error names the member and why), a second extracts exactly the members the first saw,
through tarfile's "data" filter as a second line of defence. The decompressed stream is counted as
it is read, so a gzip bomb whose headers lie is stopped too.

Cached trees are read-only (directories 0o555, files 0o444 or 0o555), so `shutil.rmtree` alone
cannot delete them: `remove_cached` renames the tree aside, makes its directories writable again,
then removes it.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import io
import os
import re
import shutil
import stat
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from rank_contract.failures import Failure, named

SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
# Headers, padding and pax records a member may bring beyond its data; long names fit with room to spare.
HEADER_ALLOWANCE = 4096
READ_SLACK = 1 << 20
MAX_SYMLINK_DEPTH = 40  # as Linux's own limit
_SPECIAL = {
    tarfile.CHRTYPE: "character device",
    tarfile.BLKTYPE: "block device",
    tarfile.FIFOTYPE: "fifo",
    tarfile.CONTTYPE: "contiguous file",
    tarfile.GNUTYPE_SPARSE: "sparse file",
}


class CodeArchiveError(Exception):
    """A code archive could not be used; the message says which and why."""


@named(Failure.CODE_MISSING)
class CodeMissing(CodeArchiveError):
    """The archive file is not there."""


@named(Failure.CODE_CORRUPT)
class CodeCorrupt(CodeArchiveError):
    """The archive's bytes do not have the sha256 they were stored under."""


@named(Failure.UNSAFE_ARCHIVE)
class UnsafeArchive(CodeArchiveError):
    """The archive holds something that could write outside its tree or exhaust the worker."""


def sha256_of(path: Path) -> str:
    """The sha256 of a file, read in chunks."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


class _BoundedReader(io.BufferedIOBase):
    """The decompressed stream, refusing to give more than `limit` bytes (headers may lie about sizes)."""

    def __init__(self, raw: io.BufferedIOBase, limit: int) -> None:
        super().__init__()
        self.raw, self.limit, self.count = raw, limit, 0

    def readable(self) -> bool:
        """A reader, never a writer."""
        return True

    def read(self, size: int | None = -1) -> bytes:
        """At most `size` bytes; raises UnsafeArchive once the stream passes the limit."""
        room = self.limit - self.count + 1
        data = self.raw.read(room if size is None or size < 0 else min(size, room))
        self.count += len(data)
        if self.count > self.limit:
            raise UnsafeArchive(f"the archive decompresses to more than {self.limit} bytes")
        return data


@contextmanager
def _reading(archive: Path, reader_limit: int) -> Iterator[tuple[tarfile.TarFile, _BoundedReader]]:
    """The archive as a forward-only tar stream over a bounded reader; tar and gzip errors are named."""
    with open(archive, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
        reader = _BoundedReader(gz, reader_limit)
        try:
            with tarfile.open(fileobj=reader, mode="r|", encoding="utf-8") as tar:
                yield tar, reader
        except tarfile.FilterError as exc:
            raise UnsafeArchive(f"{archive.name}: refused by tarfile's data filter: {exc}") from exc
        except (tarfile.TarError, gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise CodeArchiveError(f"{archive.name} is not a readable tar.gz archive: {exc}") from exc


def _normalised(name: str) -> str:
    path = PurePosixPath(name)
    if path.is_absolute():
        raise UnsafeArchive(f"{name!r}: absolute path")
    if ".." in path.parts:
        raise UnsafeArchive(f"{name!r}: '..' in the path")
    return "/".join(path.parts)


class _Links:
    """Resolves symlink targets inside the tree the way the kernel will, following the archive's links."""

    def __init__(self, links: dict[str, str]) -> None:
        self.links = links
        self.done: dict[str, tuple[str, ...]] = {}
        self.busy: set[str] = set()

    def where(self, link: str) -> tuple[str, ...]:
        """The in-tree path `link` resolves to; ValueError says why when it leaves the tree."""
        if link in self.done:
            return self.done[link]
        if link in self.busy:
            raise ValueError("is part of a symlink loop")
        if len(self.busy) >= MAX_SYMLINK_DEPTH:
            raise ValueError(f"goes through more than {MAX_SYMLINK_DEPTH} symlinks")
        self.busy.add(link)
        parent = tuple(link.split("/")[:-1])
        self.done[link] = self.follow(parent, self.links[link])
        self.busy.discard(link)
        return self.done[link]

    def follow(self, start: tuple[str, ...], target: str) -> tuple[str, ...]:
        """Where `target`, read from directory `start`, lands."""
        parts = list(start)
        for comp in target.split("/"):
            if comp in ("", "."):
                continue
            if comp == "..":
                if not parts:
                    raise ValueError("leaves the tree")
                parts.pop()
                continue
            parts.append(comp)
            joined = "/".join(parts)
            if joined in self.links:
                parts = list(self.where(joined))
        return tuple(parts)


def _describe(info: tarfile.TarInfo) -> tuple[str, bytes, int, str]:
    return info.name, info.type, info.size, info.linkname


def _check_member(info: tarfile.TarInfo) -> str:
    """The member's normalised name, or UnsafeArchive naming what is wrong with it."""
    name = _normalised(info.name)
    if info.islnk():
        raise UnsafeArchive(f"{info.name!r}: hard link to {info.linkname!r} (hard links are refused)")
    if info.issym():
        if not info.linkname:
            raise UnsafeArchive(f"{info.name!r}: symlink with an empty target")
        if PurePosixPath(info.linkname).is_absolute():
            raise UnsafeArchive(f"{info.name!r}: symlink to the absolute path {info.linkname!r}")
    elif not (info.isdir() or info.type in (tarfile.REGTYPE, tarfile.AREGTYPE)):
        what = _SPECIAL.get(info.type, f"member of type {info.type!r}")
        raise UnsafeArchive(f"{info.name!r}: a {what}, not a regular file, directory or symlink")
    if not name and not info.isdir():
        raise UnsafeArchive(f"{info.name!r}: an empty name")
    return name


def _check_tree(names: dict[str, str], links: dict[str, str], files: set[str]) -> None:
    """Refuse members written through a symlink or into a file, and symlinks whose target leaves the tree."""
    for name, raw in names.items():
        parts = name.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in links:
                raise UnsafeArchive(f"{raw!r}: written through the symlink {prefix!r}")
            if prefix in files:
                raise UnsafeArchive(f"{raw!r}: written inside the file {prefix!r}")
    resolver = _Links(links)
    for name, target in links.items():
        try:
            resolver.where(name)
        except ValueError as why:
            raise UnsafeArchive(f"{names[name]!r}: symlink to {target!r} {why}") from None


def _reader_limit(max_unpacked_bytes: int, members: int) -> int:
    return max_unpacked_bytes + (members + 1) * HEADER_ALLOWANCE + READ_SLACK


def _survey(archive: Path, *, max_unpacked_bytes: int, max_members: int) -> list[tuple[str, bytes, int, str]]:
    """Read every header (and skip every body) of the archive, refusing anything hostile."""
    seen: list[tuple[str, bytes, int, str]] = []
    names: dict[str, str] = {}
    links: dict[str, str] = {}
    files: set[str] = set()
    total = 0
    with _reading(archive, _reader_limit(max_unpacked_bytes, 0)) as (tar, reader):
        for info in tar:
            if len(seen) >= max_members:
                raise UnsafeArchive(f"{archive.name}: more than {max_members} members")
            name = _check_member(info)
            if name in names:
                raise UnsafeArchive(f"{info.name!r}: a second member named {name!r}")
            total += info.size
            if total > max_unpacked_bytes:
                raise UnsafeArchive(f"{info.name!r}: members unpack to over {max_unpacked_bytes} bytes")
            if name:
                names[name] = info.name
            if info.issym():
                links[name] = info.linkname
            elif info.isreg():
                files.add(name)
            seen.append(_describe(info))
            reader.limit = _reader_limit(max_unpacked_bytes, len(seen))
    _check_tree(names, links, files)
    return seen


def safe_extract(archive: Path, dest: Path, *, max_unpacked_bytes: int, max_members: int = 100_000) -> None:
    """Extract a tar.gz into `dest`, first refusing (UnsafeArchive) what could escape or exhaust it."""
    expected = _survey(archive, max_unpacked_bytes=max_unpacked_bytes, max_members=max_members)
    dest.mkdir(parents=True, exist_ok=True)
    with _reading(archive, _reader_limit(max_unpacked_bytes, len(expected))) as (tar, _):

        def same_members() -> Iterator[tarfile.TarInfo]:
            # The file could change between the passes: extract only what the survey approved.
            for i, info in enumerate(tar):
                if i >= len(expected) or _describe(info) != expected[i]:
                    raise UnsafeArchive(f"{info.name!r}: the archive changed while it was read")
                yield info

        tar.extractall(dest, members=same_members(), filter="data")


def _make_read_only(top: Path) -> None:
    for dirpath, _, filenames in os.walk(top):
        os.chmod(dirpath, 0o555)
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode):  # a symlink's own mode means nothing; never chmod through it
                os.chmod(path, 0o555 if mode & stat.S_IXUSR else 0o444)


def _remove_tree(top: Path) -> None:
    """Remove a (possibly read-only) tree: its directories are made writable first, top down."""
    if not top.exists():
        return
    for dirpath, _, _ in os.walk(top):
        os.chmod(dirpath, 0o700)
    shutil.rmtree(top)


def _check_hash(sha256: str) -> None:
    if not SHA256_PATTERN.fullmatch(sha256):
        raise ValueError(f"not a sha256 (64 lowercase hex digits): {sha256!r}")


@contextmanager
def _locked(cache_dir: Path, sha256: str) -> Iterator[None]:
    """Hold the per-hash lock; flock locks an open file, so threads and processes both wait."""
    if not cache_dir.is_dir():
        cache_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(cache_dir, 0o711)  # others may enter a tree whose hash they know, not list the cache
    locks = cache_dir / ".locks"
    locks.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(locks / f"{sha256}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def unpack_cached(*, archive: Path, sha256: str, cache_dir: Path, max_unpacked_bytes: int) -> Path:
    """The read-only tree of `archive` at cache_dir/<sha256>, extracted once (verified first) if not there."""
    _check_hash(sha256)
    final = cache_dir / sha256
    if final.is_dir():
        return final
    with _locked(cache_dir, sha256):
        if final.is_dir():
            return final
        if not archive.is_file():
            raise CodeMissing(f"no code archive at {archive}")
        actual = sha256_of(archive)
        if actual != sha256:
            raise CodeCorrupt(f"{archive} has sha256 {actual}, not the expected {sha256}")
        for stale in cache_dir.glob(f".tmp-{sha256}-*"):  # left by a worker that died mid-way
            _remove_tree(stale)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{sha256}-", dir=cache_dir))
        try:
            safe_extract(archive, tmp, max_unpacked_bytes=max_unpacked_bytes)
            _make_read_only(tmp)
            os.rename(tmp, final)
        except BaseException:
            _remove_tree(tmp)
            raise
    return final


def remove_cached(cache_dir: Path, sha256: str) -> bool:
    """Delete the cached tree of `sha256` (False if none); renamed aside first, so never left half there."""
    _check_hash(sha256)
    final = cache_dir / sha256
    if not final.is_dir():
        return False
    with _locked(cache_dir, sha256):
        if not final.is_dir():
            return False
        trash = cache_dir / f".tmp-{sha256}-removed"
        _remove_tree(trash)
        os.rename(final, trash)
        _remove_tree(trash)
    return True
